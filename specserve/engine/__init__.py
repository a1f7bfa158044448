"""Sequences, the step loop that speculates and verifies a whole batch, and its stats."""
