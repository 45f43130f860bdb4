"""Decoding under torch.inference_mode against no_grad: the same decoder, the same batches, one CPU thread.

``BeamDecoder.generate`` enters :func:`fairseq_stream.inference_mode.decoding`;
this script swaps that for ``torch.no_grad`` (what decoding ran under before)
and times both, interleaved, one sentence at a time and in batches. It also
checks that both modes give the same hypotheses (tokens and scores, exactly).

    python benchmarks/bench_inference_mode.py MODEL_DIR --checkpoints transformer/checkpoint_best.pt \\
        [--runner lean] [--beam 5] [--subset valid] [--limit 100] [--rounds 3]

MODEL_DIR holds data-bin/ and the checkpoints (what scripts/train_multi30k.sh or
scripts/train_toy.sh write).
"""

import preamble  # first: the import paths, then the threads before torch starts its pools

preamble.set_threads(1)

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from bench_output_layer import cpu_name  # noqa: E402
from bench_search import load, make_batches  # noqa: E402

import fairseq_stream.decoder as decoder_module  # noqa: E402
from fairseq_stream.decoder import BeamDecoder  # noqa: E402
from fairseq_stream.runners.rnn import RnnOptions  # noqa: E402

MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--checkpoints", default="transformer/checkpoint_best.pt")
    parser.add_argument("--runner", default="auto")
    parser.add_argument("--rnn-int16", action="store_true")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--subset", default="valid")
    parser.add_argument("--limit", type=int, default=100, help="sentences with id < N")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    models, task = load(args.model_dir, args.checkpoints)
    decoder = BeamDecoder(models, task.target_dictionary, beam_size=args.beam, finalize="fairseq",
                          runner=args.runner, keep_reference=False, output_layer="auto",
                          rnn_options=RnnOptions(int16=args.rnn_int16))
    settings = {"one at a time": make_batches(task, args.subset, 1, args.limit),
                "batched ({})".format(args.batch_size): make_batches(task, args.subset, args.batch_size, args.limit)}
    print("machine: {}; torch {}; one thread; {} ({} runner), beam {}".format(
        cpu_name(), torch.__version__, args.checkpoints, decoder.runner.name, args.beam))
    print("| setting | sentences | no_grad s | inference_mode s | speedup |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for setting, batches in settings.items():
        walls = {name: [] for name in MODES}
        outputs = {}
        for _ in range(args.rounds):
            for name, mode in MODES.items():
                decoder_module.decoding = mode
                out = {}
                start = time.perf_counter()
                for sample in batches:
                    for sid, hyps in zip(sample["id"].tolist(), decoder.generate(models, sample)):
                        out[sid] = [(h["tokens"].tolist(), float(h["score"])) for h in hyps]
                walls[name].append(time.perf_counter() - start)
                outputs[name] = out
        if outputs["no_grad"] != outputs["inference_mode"]:
            sys.exit("bench_inference_mode: the two modes gave different hypotheses ({})".format(setting))
        a, b = statistics.median(walls["no_grad"]), statistics.median(walls["inference_mode"])
        print("| {} | {} | {:.3f} | {:.3f} | {:.2f}x |".format(setting, len(outputs["no_grad"]), a, b, a / b))
    decoder_module.decoding = MODES["inference_mode"]


if __name__ == "__main__":
    main()
