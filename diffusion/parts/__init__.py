"""The protocol and the parts every method is made of (see `remask.diffusion`)."""
