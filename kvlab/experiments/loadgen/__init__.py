"""`kvlab bench serve`: the load generator for OpenAI-compatible servers and the paired serving sweep."""
