"""The generation wing: token selection, the static batch engine, the slot engine and its programs.

`sampling` draws tokens; `static.Sampler` plays fixed batches; `slots.SlotSampler` runs continuous batching over
a slot cache. Both engines read weights from a source the learner publishes to and return every token with
the version of the weights that produced it.
"""
