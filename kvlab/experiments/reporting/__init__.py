"""Console tables and PNG plots shared by the experiments."""
