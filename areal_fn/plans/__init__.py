"""Plans derived from layouts: transfers and their lower bound, checkpoint manifests, conversion, memory, census, advice."""
