"""Train a joint sentencepiece model on Multi30k De-En and encode the splits.

    python scripts/spm_prepare.py DATA_DIR OUT_DIR [--vocab 8000]

DATA_DIR holds the raw Multi30k text (train.de, train.en, val.*, test_2016_flickr.*,
...). OUT_DIR gets spm.model and {train,valid,test}.{de,en} as pieces, ready for
fairseq-preprocess. Deterministic: sentencepiece is single-threaded here with
a fixed seed-free training order (no sampling of the input).
"""

import argparse
import os

import sentencepiece as spm

SPLITS = {"train": "train", "valid": "val", "test": "test_2016_flickr"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--vocab", type=int, default=8000)
    args = parser.parse_args()
    # Checked before out_dir is made: sentencepiece's NOT_FOUND came as a traceback, after it.
    for lang in ("de", "en"):
        if not os.path.isfile(os.path.join(args.data_dir, "train." + lang)):
            parser.error("{}: no train.{} (the Multi30k text: train, valid and test_2016_flickr .de/.en)".format(
                args.data_dir, lang))
    os.makedirs(args.out_dir, exist_ok=True)
    prefix = os.path.join(args.out_dir, "spm")
    spm.SentencePieceTrainer.train(
        input=",".join(os.path.join(args.data_dir, "train." + lang) for lang in ("de", "en")),
        model_prefix=prefix,
        vocab_size=args.vocab,
        model_type="unigram",
        character_coverage=1.0,
        num_threads=1,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        bos_id=-1,
        eos_id=-1,
        pad_id=-1,
        unk_id=0,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
    for split, name in SPLITS.items():
        for lang in ("de", "en"):
            src = os.path.join(args.data_dir, "{}.{}".format(name, lang))
            with open(src, encoding="utf-8") as f, open(
                os.path.join(args.out_dir, "{}.{}".format(split, lang)), "w", encoding="utf-8"
            ) as out:
                for line in f:
                    out.write(" ".join(sp.encode(line.rstrip("\n"), out_type=str)) + "\n")


if __name__ == "__main__":
    main()
