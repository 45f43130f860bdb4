"""Our best CPU layout against CTranslate2's best, on the same cores, with and without a busy process (issue 50).

For each model, precision (float32, int8) and search (greedy, fixed k=5,
var-batch k=5), on 1 core and on 2 (``taskset``), with the cores free and
with a process spinning on the first core beside the run:

* ours: the real ``fairseq-generate --cpu`` with every layout of the cores
  (1 core: one worker, one thread; 2 cores: ``--cpu-workers 2 --cpu-threads
  1`` and ``--cpu-workers 1 --cpu-threads 2``); decoding seconds: in one
  process, the time inside fairseq-generate's ``generate`` calls (its
  ``Translated N sentences ... (R sentences/s)`` line), which leaves out its
  printing between batches as CTranslate2's time leaves out output; with CPU
  workers, the wall window from the first ``generate`` call's start to the
  last one's end, as our closing counters log it, since the workers decode
  ahead while fairseq-generate prints between calls (the ``Translated`` line
  made two workers look up to 4x faster than they are); the parent's
  printing then shares the cores with the workers; the whole process from
  the start of the command to its end. Every run of ours also records that
  wall window (``window_s``: one process prints between its ``generate``
  calls inside it too), and the summary gives our second core's gain both
  ways: decode seconds (1 core's time inside ``generate`` against 2 cores'
  window, which holds the parent's printing: the 2-core side pays for work
  the 1-core side leaves out) and windows against windows (the same span on
  both sides: fairseq-generate's throughput from its first batch to its
  last, printing included). Every run must print the
  1-core run's translations, bit for bit (the layout changes when work is
  done, never what is produced), or the script stops;
* CTranslate2 (the ``bench`` extra, ``benchmarks/ctranslate2_peer.py``) on the
  converted checkpoint, in a process of its own, with every layout of
  ``inter_threads`` x ``intra_threads`` on the same cores, compute type
  float32 or int8, beam 1 or 5 (it has no variable-width search: var-batch
  k=5 is compared with its beam 5); decoding seconds around
  ``translate_batch`` (``max_batch_size`` = our batch size), the whole
  process likewise.

The best layout of each side counts (fastest of ``--rounds`` interleaved
rounds). Models: ``--model NAME=DATA_BIN:CHECKPOINT:SUBSET[:EXTRA fairseq options]``,
default the toy; ``--standin DIR`` adds the WMT'19-sized stand-in (built with
``scripts/make_wmt19_standin.py de-en DIR --models 1`` when DIR holds none,
its input the first ``--standin-sentences`` lines of newstest2017, its junk
outputs bounded by ``--max-len-a 1.2 --max-len-b 10``); ``--m30k DIR`` adds
the Multi30k transformer of ``scripts/train_multi30k.sh`` where
``DIR/transformer/checkpoint_best.pt`` exists (45 minutes of training: the
script says when it is absent and goes on without it); only when asked for,
as the stand-in is, so that a stand-in run does not time the Multi30k rows too. The machine's load
(1-minute average) is recorded before and after every run, with the CPU's
model and SIMD level.

``--systems ours`` times our layouts alone (the summary then has no
CTranslate2 columns): the second core's gain where CTranslate2's float32
runs of the stand-in would take minutes each.

    python benchmarks/bench_interop.py [--standin runs/standin] [--m30k runs/m30k] \\
        [--rounds 2] [--systems ours] [--json docs/bench/interop_cpu_xeon.json]
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

import preamble  # noqa: F401  (first: paths)
from bench_threads import TRANSLATED, cpu_model
from busy_core import busy_core

# Our decoder's closing counters (fairseq_stream/stats.py): the wall window from the first generate call's
# start to the last one's end.
WINDOW = re.compile(r"([\d.]+)s from the first batch's start to the last one's end")

SEARCHES = {"greedy": (["--search", "greedy"], 1),
            "fixed k=5": (["--search", "fixed", "--beam", "5", "--runner", "lean"], 5),
            "var-batch k=5": (["--search", "var-batch", "--beam", "5"], 5)}
PRECISIONS = {"float32": [], "int8": ["--quantize", "int8"]}
# (cores, our layouts as (label, workers, threads), CTranslate2's as (label, inter, intra))
LAYOUTS = {1: ([("1 worker x 1 thread", 1, 1)], [("inter 1 x intra 1", 1, 1)]),
           2: ([("2 workers x 1 thread", 2, 1), ("1 worker x 2 threads", 1, 2)],
               [("inter 2 x intra 1", 2, 1), ("inter 1 x intra 2", 1, 2)])}
STANDIN_OPTIONS = ["--max-len-a", "1.2", "--max-len-b", "10"]
BIN = os.path.dirname(sys.executable)  # this venv's fairseq tools


def pinned(cores: int):
    """The ``taskset`` prefix for the first ``cores`` cores, and their thread variables."""
    cpus = sorted(os.sched_getaffinity(0))[:cores]
    env = {name: str(cores) for name in preamble.THREAD_VARIABLES}
    return ["taskset", "-c", ",".join(map(str, cpus))], env


def ours(model, options, cores, workers, threads, batch_size):
    """(decoding seconds, whole process seconds, hypotheses) of one fairseq-generate run."""
    prefix, env = pinned(cores)
    argv = prefix + [os.path.join(BIN, "fairseq-generate"), model["data_bin"], "--path", model["checkpoint"], "--user-dir",
                     os.path.join(preamble.REPO, "fairseq_stream"), "--gen-subset", model["subset"], "--batch-size",
                     str(batch_size), "--cpu", "--cpu-workers", str(workers), "--cpu-threads", str(threads)]
    start = time.perf_counter()
    proc = subprocess.run(argv + options + model["extra"], env=dict(os.environ, PYTHONPATH=preamble.REPO, **env),
                          capture_output=True, text=True)
    whole = time.perf_counter() - start
    found = TRANSLATED.search(proc.stderr + proc.stdout)
    if proc.returncode != 0 or not found:
        sys.exit("bench_interop: {} failed ({}):\n{}".format(" ".join(argv), proc.returncode, proc.stderr[-3000:]))
    hyps = [line for line in proc.stdout.splitlines() if line.startswith(("H-", "P-"))]
    window = WINDOW.search(proc.stderr)
    if window is None:
        sys.exit("bench_interop: {} printed no decode window".format(" ".join(argv)))
    return decode_seconds(found, window, workers), float(window.group(1)), whole, sorted(hyps)


def decode_seconds(translated, window, workers: int) -> float:
    """One process: the time inside fairseq-generate's ``generate`` calls (its ``Translated`` line); CPU
    workers: the decode's wall window, since they decode ahead while the parent prints between calls."""
    if workers == 1:
        return int(translated.group(1).replace(",", "")) / float(translated.group(4))
    return float(window.group(1))


def ctranslate2(model, compute_type, beam, cores, inter, intra, batch_size):
    """(decoding seconds, whole process seconds) of CTranslate2 in a process of its own."""
    prefix, env = pinned(cores)
    argv = prefix + [sys.executable, os.path.abspath(__file__), "--ct2-run", json.dumps(dict(
        model=model, compute_type=compute_type, beam=beam, inter=inter, intra=intra, batch_size=batch_size))]
    start = time.perf_counter()
    proc = subprocess.run(argv, env=dict(os.environ, **env), capture_output=True, text=True)
    whole = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit("bench_interop: CTranslate2 run failed ({}):\n{}".format(proc.returncode, proc.stderr[-3000:]))
    return json.loads(proc.stdout.strip().splitlines()[-1])["decode_s"], whole


def ct2_run(spec):
    """In a process of its own: load the converted model, translate the subset, print the decoding seconds."""
    import ctranslate2
    from fairseq import tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq import options as fairseq_options

    import ctranslate2_peer

    model = spec["model"]
    parser = fairseq_options.get_generation_parser()
    args = fairseq_options.parse_args_and_arch(parser, [model["data_bin"], "--gen-subset", model["subset"]])
    task = tasks.setup_task(convert_namespace_to_omegaconf(args).task)
    task.load_dataset(model["subset"])
    dataset = task.dataset(model["subset"])
    d = task.source_dictionary
    sources = [[d[t] for t in dataset[i]["source"].tolist() if t not in (d.pad(), d.eos())] for i in range(len(dataset))]
    model_dir = ctranslate2_peer.converted_model(model["checkpoint"], model["data_bin"], log=lambda *a: None)
    translator = ctranslate2.Translator(model_dir, device="cpu", compute_type=spec["compute_type"],
                                        inter_threads=spec["inter"], intra_threads=spec["intra"])
    a, b = model.get("max_len_a", 0.0), model.get("max_len_b", ctranslate2_peer.MAX_LEN_B)
    longest = max(len(s) for s in sources)
    start = time.perf_counter()
    translator.translate_batch(sources, beam_size=spec["beam"], max_batch_size=spec["batch_size"],
                               max_decoding_length=int(a * (longest + 1) + b), min_decoding_length=1)
    print(json.dumps({"decode_s": time.perf_counter() - start}))


def load():
    return round(os.getloadavg()[0], 2)


def run_case(model, precision, search, cores, busy, args, best, reference):
    """Time every layout of both sides for one case; keep each layout's fastest."""
    options, beam = SEARCHES[search]
    our_layouts, ct2_layouts = LAYOUTS[cores]
    runs = [("ours",) + layout for layout in our_layouts] + [("ctranslate2",) + layout for layout in ct2_layouts]
    runs = [run for run in runs if run[0] in args.systems]
    for system, label, first, second in runs:
        before = load()
        with busy_core(busy, sorted(os.sched_getaffinity(0))[0]):  # the first core, which a 1-core run takes too
            window_s = None
            if system == "ours":
                decode_s, window_s, whole, hyps = ours(model, options + PRECISIONS[precision], cores, first, second,
                                             args.batch_size)
                key = (model["name"], precision, search)
                if reference.setdefault(key, hyps) != hyps:
                    sys.exit("bench_interop: {} on {} gave other translations than the first run".format(key, label))
            else:
                decode_s, whole = ctranslate2(model, precision, beam, cores, first, second, args.batch_size)
        key = (model["name"], precision, search, cores, busy, system, label)
        row = {"model": model["name"], "precision": precision, "search": search, "cores": cores,
               "busy_core": busy, "system": system, "layout": label, "decode_s": round(decode_s, 3),
               "process_s": round(whole, 3), "load_before": before, "load_after": load()}
        if window_s is not None:
            row["window_s"] = round(window_s, 3)
        kept = best.get(key)
        if kept is None or decode_s < kept["decode_s"]:
            best[key] = row
        if kept is not None and "window_s" in kept:  # each layout's fastest window, whichever round it was
            best[key]["window_s"] = min(kept["window_s"], row["window_s"])
        print("  {model:<8} {precision:<8} {search:<14} {cores} core(s) busy={busy_core!s:<5} {system:<12} "
              "{layout:<22} decode {decode_s:7.2f} s  process {process_s:7.2f} s  load {load_before}".format(**row)
              + ("  window {:.2f} s".format(window_s) if window_s is not None else ""),
              flush=True)



def model_spec(text):
    """``NAME=DATA_BIN:CHECKPOINT:SUBSET[:EXTRA]`` as a model entry."""
    name, rest = text.split("=", 1)
    parts = rest.split(":", 3)
    return {"name": name, "data_bin": parts[0], "checkpoint": parts[1], "subset": parts[2],
            "extra": parts[3].split() if len(parts) > 3 else []}


def toy_spec():
    sys.path.insert(0, os.path.join(preamble.REPO, "scripts"))
    import toy_cache

    root = toy_cache.ensure()
    return model_spec("toy={}/data-bin:{}/transformer/checkpoint_best.pt:valid".format(root, root))


def m30k_spec(folder):
    """The Multi30k transformer where it is trained, else None (and a line saying so)."""
    checkpoint = os.path.join(folder, "transformer", "checkpoint_best.pt")
    if not os.path.exists(checkpoint):
        print("bench_interop: no Multi30k model at {} (bash scripts/train_multi30k.sh DATA_DIR {}: about 45 "
              "minutes on 2 cores); going on without it".format(checkpoint, folder))
        return None
    return model_spec("m30k={}/data-bin:{}:test".format(folder, checkpoint))


def standin_spec(folder, sentences, text_dir):
    """The WMT'19-sized stand-in (one model), built where missing, on the first lines of newstest2017."""
    model = os.path.join(folder, "model1.pt")
    if not os.path.exists(os.path.join(folder, "standin.json")):
        train = [os.path.join(text_dir, "newstest201{}.{}".format(y, l)) for y in (3, 4, 5, 6) for l in ("de", "en")]
        subprocess.run([sys.executable, os.path.join(preamble.REPO, "scripts", "make_wmt19_standin.py"), "de-en",
                        folder, "--models", "1", "--train-text"] + train, check=True)
    data_bin = os.path.join(folder, "bench-bin-{}".format(sentences))
    if not os.path.exists(os.path.join(data_bin, "test.de-en.de.bin")):
        lines = open(os.path.join(text_dir, "newstest2017.de")).read().splitlines()[:sentences]
        os.makedirs(data_bin, exist_ok=True)
        with open(os.path.join(data_bin, "input.de"), "w") as f:
            f.write("\n".join(lines) + "\n")  # whitespace words: speed, not BLEU (untrained weights)
        subprocess.run([os.path.join(BIN, "fairseq-preprocess"), "-s", "de", "-t", "en", "--only-source", "--testpref",
                        os.path.join(data_bin, "input"), "--destdir", data_bin, "--srcdict",
                        os.path.join(folder, "dict.de.txt"), "--workers", "1"], check=True, capture_output=True)
        subprocess.run(["cp", os.path.join(folder, "dict.en.txt"), data_bin], check=True)
    spec = model_spec("standin={}:{}:test:-s de -t en {}".format(data_bin, model, " ".join(STANDIN_OPTIONS)))
    spec.update(max_len_a=1.2, max_len_b=10)
    return spec


def summary(best):
    """Per case: our best layout, CTranslate2's best, their ratio; our 2 cores over our 1 core."""
    cases = sorted({k[:5] for k in best}, key=str)
    out = []
    for case in cases:
        side = {system: min((r for k, r in best.items() if k[:5] == case and k[5] == system),
                            key=lambda r: r["decode_s"], default=None) for system in ("ours", "ctranslate2")}
        one_core = [r for k, r in best.items() if k[:4] == case[:3] + (1,) and k[4] == case[4] and k[5] == "ours"]
        row = {"model": case[0], "precision": case[1], "search": case[2], "cores": case[3], "busy_core": case[4]}
        if side["ours"] is not None:
            row.update(ours_layout=side["ours"]["layout"], ours_decode_s=side["ours"]["decode_s"],
                       ours_process_s=side["ours"]["process_s"])
        if side["ctranslate2"] is not None:
            row.update(ct2_layout=side["ctranslate2"]["layout"], ct2_decode_s=side["ctranslate2"]["decode_s"],
                       ct2_process_s=side["ctranslate2"]["process_s"])
        if None not in side.values():
            row.update(decode_over_ct2=round(side["ours"]["decode_s"] / side["ctranslate2"]["decode_s"], 3),
                       process_over_ct2=round(side["ours"]["process_s"] / side["ctranslate2"]["process_s"], 3))
        runs = [r for k, r in best.items() if k[:5] == case]
        row["load"] = [min(r["load_before"] for r in runs), max(r["load_after"] for r in runs)]
        windows = [r["window_s"] for k, r in best.items() if k[:5] == case and k[5] == "ours" and "window_s" in r]
        if windows:
            row["ours_window_s"] = min(windows)
        if one_core and case[3] > 1 and side["ours"] is not None:
            row["ours_speedup_over_1_core"] = round(min(r["decode_s"] for r in one_core) / row["ours_decode_s"], 3)
            if windows and all("window_s" in r for r in one_core):
                row["ours_window_speedup_over_1_core"] = round(min(r["window_s"] for r in one_core) / min(windows), 3)
        out.append(row)
    return out


def write(path, models, best):
    """The summary of what ``best`` holds, written to ``path`` (where given) with every run; returns it."""
    rows = summary(best)
    if path:
        with open(path, "w") as f:
            json.dump({"cpu": cpu_model(), "argv": sys.argv, "date": time.strftime("%Y-%m-%d"),
                       "models": models, "summary": rows, "runs": list(best.values())}, f, indent=1)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ct2-run", help=argparse.SUPPRESS)
    parser.add_argument("--model", action="append", default=[], type=model_spec,
                        help="NAME=DATA_BIN:CHECKPOINT:SUBSET[:EXTRA] (default: the toy's valid set)")
    parser.add_argument("--no-toy", action="store_true", help="leave the toy out (where no --model is given)")
    parser.add_argument("--standin", metavar="DIR", help="add the WMT'19-sized stand-in (built here if missing)")
    parser.add_argument("--standin-sentences", type=int, default=16)
    parser.add_argument("--text-dir", default=os.path.join(preamble.REPO, "..", "shared", "data", "wmt", "de-en"))
    parser.add_argument("--m30k", metavar="DIR", help="add the Multi30k transformer trained into DIR (e.g. runs/m30k)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--cores", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--busy", nargs="+", default=["no", "yes"], choices=["no", "yes"])
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS))
    parser.add_argument("--searches", nargs="+", default=list(SEARCHES))
    parser.add_argument("--systems", nargs="+", default=["ours", "ctranslate2"], choices=["ours", "ctranslate2"],
                        help="whose layouts to time (default both; ours alone for our second core's gain, where "
                             "CTranslate2's float32 runs of the stand-in take minutes each)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.ct2_run:
        return ct2_run(json.loads(args.ct2_run))
    models = args.model or ([] if args.no_toy else [toy_spec()])
    models += [m for m in (([m30k_spec(args.m30k)] if args.m30k else []) + ([standin_spec(args.standin, args.standin_sentences,
                                                                    args.text_dir)] if args.standin else [])) if m]
    import ctranslate2_peer

    for model in models if "ctranslate2" in args.systems else []:  # converted once, before any run is timed
        ctranslate2_peer.converted_model(model["checkpoint"], model["data_bin"])
    best, reference = {}, {}
    print("bench_interop: {}; load {} at the start".format(cpu_model(), load()), flush=True)
    for _ in range(args.rounds):
        for model in models:
            for precision in args.precisions:
                for search in args.searches:
                    for cores in args.cores:
                        for busy in args.busy:
                            run_case(model, precision, search, cores, busy == "yes", args, best, reference)
                            write(args.json, models, best)  # as it goes: a run cut short keeps what it measured
    rows = write(args.json, models, best)
    for r in rows:
        gain = ""
        if "ours_speedup_over_1_core" in r:
            gain = "; over 1 core {:.2f}x (decode), {:.2f}x (windows)".format(
                r["ours_speedup_over_1_core"], r.get("ours_window_speedup_over_1_core", float("nan")))
        line = "{model:<8} {precision:<8} {search:<14} {cores} core(s) busy={busy_core!s:<5}".format(**r)
        if "ours_decode_s" in r:
            line += " ours {ours_decode_s:7.2f} s ({ours_layout})".format(**r)
        if "ct2_decode_s" in r:
            line += " CT2 {ct2_decode_s:7.2f} s ({ct2_layout})".format(**r)
        if "decode_over_ct2" in r:
            line += ": {decode_over_ct2:.2f}x; process {process_over_ct2:.2f}x".format(**r)
        print(line + gain)


if __name__ == "__main__":
    main()
