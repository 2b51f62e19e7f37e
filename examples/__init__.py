"""Small services that embed the stablewatch agent: a token bank, dining philosophers, a terminating job."""
