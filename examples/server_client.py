"""Stream a chat from `mlx_lm.server --draft-model ...` with the `openai`
client, and print the request's speculative statistics (`usage.speculative`).

With --url it talks to a server you started; otherwise it starts one on
127.0.0.1 with --model and --draft-model (the bundled tiny pair by default)
and stops it at the end. Needs `pip install openai`.
"""

import argparse
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

TINY = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "deepspec-tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, draft_model: str) -> tuple:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mlx_lm", "server", "--model", model,
         "--draft-model", draft_model, "--host", "127.0.0.1", "--port", str(port)],
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1"
    for _ in range(600):
        if server.poll() is not None:
            sys.exit(f"mlx_lm.server exited with status {server.returncode}")
        try:
            urllib.request.urlopen(f"{url}/models", timeout=1)
            return server, url
        except OSError:
            time.sleep(0.2)
    server.terminate()
    sys.exit("mlx_lm.server did not start within two minutes")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8080/v1")
    parser.add_argument("--model", default=str(TINY / "target_tiny_gemma4"))
    parser.add_argument("--draft-model", default=str(TINY / "dspark_tiny_gemma4_block4"))
    parser.add_argument("--prompt", default="w65 w211 w266 w241 w234 w10 w325")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    try:
        from openai import OpenAI
    except ImportError:
        sys.exit("This example needs the openai client: pip install openai")

    server, url = (None, args.url) if args.url else start_server(args.model, args.draft_model)
    try:
        client = OpenAI(base_url=url, api_key="not-needed")
        stream = client.chat.completions.create(
            model="default_model",
            messages=[{"role": "user", "content": args.prompt}],
            max_tokens=args.max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
            usage = chunk.usage or usage
        print()
        # mlx-dspark's addition to the usage object (absent without a drafter).
        speculative = (usage.model_extra or {}).get("speculative")
        print(f"usage.speculative: {speculative}")
    finally:
        if server is not None:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
