"""`kvlab simulate pool`: N engines on one GPU, one elastic KV pool against static splits
(docs/simulator-serving.md)."""
