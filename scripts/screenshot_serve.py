"""A screenshot of `mbolt serve`'s page under load -> docs/serve_page.png.

A synthetic MoE (8 layers x 64 experts, llama.cpp's Qwen2 test vocabulary and chat template) served
with a budget smaller than the model (the cache holds part of each layer) and 4 slots; 4 clients
stream replies at once through the `openai` client while headless Chromium (Debian's chromium and
chromedriver) loads the page and waits for the charts, the slots and the cache map to fill.

    python scripts/fetch_test_vocabs.py && python scripts/screenshot_serve.py [--out docs/serve_page.png]
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOCAB = ROOT / "tests" / ".vocabs" / "ggml-vocab-qwen2.gguf"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "serve_page.png")
    ap.add_argument("--ram", default="500M")
    a = ap.parse_args()
    if not VOCAB.exists():
        print(f"error: {VOCAB} is missing: run scripts/fetch_test_vocabs.py", file=sys.stderr)
        return 2
    if shutil.which("chromium") is None or shutil.which("chromedriver") is None:
        print("error: Debian's chromium and chromium-driver are needed (bash scripts/install_browser.sh)", file=sys.stderr)
        return 2
    import openai
    from selenium import webdriver

    from mbolt.synth.synth import SynthConfig, write_synth

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "page.gguf"
        write_synth(model, SynthConfig(arch="qwen3moe", n_layers=8, n_experts=64, n_used=4, hidden=256, expert_ff=256,
                                       n_heads=4, n_kv_heads=2, head_dim=64, expert_type="Q8_0", dense_type="F16",
                                       vocab=str(VOCAB), seed=5))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        srv = subprocess.Popen([sys.executable, "-m", "mbolt", "serve", str(model), "--ram", a.ram, "-c", "1024",
                                "--parallel", "4", "--port", str(port), "--alias", "synthetic-moe-8x64"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        base = f"http://127.0.0.1:{port}"
        try:
            for _ in range(600):
                try:
                    urllib.request.urlopen(base + "/health", timeout=1)
                    break
                except OSError:
                    if srv.poll() is not None:
                        print(f"error: the server ended: {srv.stderr.read()[-500:]}", file=sys.stderr)
                        return 2
                    time.sleep(0.2)
            client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
            stop = threading.Event()

            def talk(i: int) -> None:
                while not stop.is_set():
                    s = client.chat.completions.create(model="m", stream=True, max_tokens=300, temperature=1.0,
                                                       messages=[{"role": "user", "content": f"Tell story {i}."}])
                    for _ in s:
                        if stop.is_set():
                            break

            workers = [threading.Thread(target=talk, args=(i,), daemon=True) for i in range(4)]
            for w in workers:
                w.start()
            opts = webdriver.ChromeOptions()
            opts.binary_location = shutil.which("chromium")
            for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        "--disable-dev-shm-usage", "--window-size=1400,900"):
                opts.add_argument(arg)
            driver = webdriver.Chrome(options=opts,
                                      service=webdriver.ChromeService(executable_path=shutil.which("chromedriver")))
            try:
                driver.get(base + "/")
                time.sleep(25)  # the charts fill one point a second
                a.out.parent.mkdir(parents=True, exist_ok=True)
                driver.save_screenshot(str(a.out))
                print(f"{a.out}: {driver.title}")
            finally:
                driver.quit()
                stop.set()
        finally:
            srv.terminate()
            srv.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
