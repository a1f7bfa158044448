"""Heads that draft from the target's features (EAGLE, Medusa): the modules and their public checkpoint layouts."""
