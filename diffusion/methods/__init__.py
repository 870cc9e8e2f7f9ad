"""The published methods as step generators over the parts (see `remask.diffusion`)."""
