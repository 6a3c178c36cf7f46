"""Real tokenizers for the tests -> tests/.vocabs/ (not in git: 0.5-7.6 MB each).

llama.cpp ships vocabulary-only GGUFs of real models with the token ids its own tokenizer test
expects (`models/ggml-vocab-NAME.gguf`, `.gguf.inp` texts, `.gguf.out` ids; llama.cpp, MIT
licence). llama-cpp-python's source distribution vendors them, so this script takes them from
the exact release mbolt pins (from PyPI, the only network the tests' machines have). The
vocabularies are those of Llama 2 (SentencePiece, as Mixtral's), Qwen2, Llama 3 and DeepSeek LLM
(byte-level BPE, each with its pre-tokenizer) and GPT-2.

    python scripts/fetch_test_vocabs.py [--dest tests/.vocabs]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RELEASE = "llama-cpp-python==0.3.36"
VOCABS = ("llama-spm", "qwen2", "llama-bpe", "deepseek-llm", "gpt-2")
SUFFIXES = (".gguf", ".gguf.inp", ".gguf.out")


def wanted(dest: Path) -> list[Path]:
    return [dest / f"ggml-vocab-{v}{s}" for v in VOCABS for s in SUFFIXES]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dest", type=Path, default=ROOT / "tests" / ".vocabs")
    a = ap.parse_args()
    if all(p.exists() for p in wanted(a.dest)):
        print(f"{a.dest}: every vocabulary is there")
        return 0
    a.dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
                            "-d", tmp, RELEASE], capture_output=True, text=True)
        sdist = next(Path(tmp).glob("*.tar.gz"), None)
        if r.returncode != 0 or sdist is None:
            print(f"error: pip could not download the {RELEASE} source: {r.stderr.strip()[-300:]}", file=sys.stderr)
            return 2
        names = {p.name for p in wanted(a.dest)}
        with tarfile.open(sdist) as tar:
            for m in tar.getmembers():
                name = Path(m.name).name
                if name in names and "/vendor/llama.cpp/models/" in m.name and m.isfile():
                    part = a.dest / (name + ".part")
                    with tar.extractfile(m) as src, open(part, "wb") as dst:
                        dst.write(src.read())
                    part.replace(a.dest / name)
    missing = [p.name for p in wanted(a.dest) if not p.exists()]
    if missing:
        print(f"error: {RELEASE} has no {', '.join(missing)}", file=sys.stderr)
        return 2
    print(f"{a.dest}: {len(names)} files from {RELEASE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
