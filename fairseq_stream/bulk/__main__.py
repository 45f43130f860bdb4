"""``python -m fairseq_stream.bulk`` (and ``torchrun -m fairseq_stream.bulk``): see :mod:`fairseq_stream.bulk`."""

from fairseq_stream.bulk import main

main()
