"""A training corpus a `gpu` model cannot memorize in a few thousand steps: the modules of Python's
standard library (tests, IDLE and installed packages left out), and with --site-packages those of
the installed packages after them (tests left out), concatenated as UTF-8 text, up to a size. For
measuring how often the multi-token heads agree with head 0 on text not seen again and again (the
bundled Shakespeare, 0.3M tokens, is memorized long before 2,000 `gpu` steps).

    python bench/stdlib_corpus.py OUT.txt [--megabytes 12] [--site-packages]
    CORPUS=OUT.txt GEN_STEPS=2000 bash bench/run_gpu.sh LOG generation
"""

import argparse
import pathlib
import sysconfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--megabytes", type=float, default=12.0)
    parser.add_argument("--site-packages", action="store_true", help="the installed packages' modules too")
    args = parser.parse_args()
    roots = [sysconfig.get_path("stdlib")] + ([sysconfig.get_path("purelib")] if args.site_packages else [])
    left_out = {"test", "tests", "testing", "idlelib", "site-packages", "dist-packages"}
    limit, texts, size = int(args.megabytes * 1e6), [], 0
    for root in map(pathlib.Path, roots):
        for path in sorted(root.rglob("*.py")):
            if left_out & set(path.relative_to(root).parts) or size >= limit:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            texts.append(text)
            size += len(text)
    args.out.write_text("\n".join(texts), encoding="utf-8")
    print(f"{args.out}: {len(texts)} modules, {size / 1e6:.1f} MB of text")


if __name__ == "__main__":
    main()
