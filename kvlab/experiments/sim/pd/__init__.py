"""`kvlab simulate pd`: prefill/decode disaggregation at GPU scale, the KV handoff copied or remapped
(docs/simulator-serving.md)."""
