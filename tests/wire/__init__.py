"""Mixed wire versions: what processes of the previous release send and read."""
