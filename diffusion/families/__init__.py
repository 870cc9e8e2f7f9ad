"""Each model family's loop as a state and a step (see `remask.diffusion`)."""
