"""Schedulers: which sentences are decoded together, and when (their ``--generator`` entries are
:mod:`fairseq_stream.plugin.schedulers`).

* :mod:`.pool`: the streaming pool (refill at ε, shortest first or FIFO) on the decoder's stepping interface;
* :mod:`.stream`: the pool as a fairseq generator, reading ahead across fairseq-generate's batches;
* :mod:`.topup`: top-up batching, the pool in FIFO order refilled at ``--topup-threshold``;
* :mod:`.maxi_batch`: batches cut from length-sorted windows of the input;
* :mod:`.read_ahead`: the encoder running ahead in a thread of its own;
* :mod:`.workers`: ``--cpu-workers``, batches decoded at once by forked processes;
* :mod:`.wrapper`: what fairseq reads of a generator that wraps the decoder (stream's, workers').
"""
