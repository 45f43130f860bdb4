"""Search policies: which candidates survive each step (their ``--search`` entries are :mod:`fairseq_stream.plugin`).

* :mod:`.policies`: the policies the engine calls (``select``), one a finalization rule: fairseq's, ``stay``;
* :mod:`.selection`: fixed-width beam selection, fairseq's and the streaming paper's finalization;
* :mod:`.pruning`: Freitag & Al-Onaizan's pruning (variable-width beams).
"""
