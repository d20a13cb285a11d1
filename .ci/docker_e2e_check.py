"""Checks .ci/docker-e2e.sh runs against the tokenizer container it started.

`--model NAME=PATH [--api-key KEY]`: the container serves exactly that model file (and refuses
/v1 requests without the key), and ids for every document of tests/data/botchan.txt (lines joined
as the tests do), through the published port, equal in-process sentencepiece ids; /metrics counted
those requests and tokens.
`--library-model NAME=PATH ...`: the container serves each of these tokenizer.json or tiktoken models,
encoded by fastokens, and its ids for the multilingual test documents equal the library's in-process.
`--inspect IMAGE --service NAME`: the image's own HEALTHCHECK passes inside the running container,
which runs as the unprivileged user on a read-only root.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import httpx
import sentencepiece as spm
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import read_documents
from tokenizer_client import TokenizerClient

ROOT = Path(__file__).resolve().parent.parent
BATCH = 256
IMAGE_USER = "10001:10001"


def sample_values(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the server's /metrics, keyed by name and sorted labels."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def check_tokenize(url: str, name: str, model_file: Path, api_key: str | None) -> None:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    if api_key:
        refused = httpx.get(f"{url}/v1/models", timeout=10)
        assert refused.status_code == 401, f"/v1/models without the API key answered {refused.status_code}"
    served = httpx.get(f"{url}/v1/models", headers=headers, timeout=10).json()
    sha256 = hashlib.sha256(model_file.read_bytes()).hexdigest()
    assert [m["name"] for m in served["models"]] == [name], served
    assert served["models"][0]["sha256"] == sha256, (served, sha256)

    processor = spm.SentencePieceProcessor(model_file=str(model_file))
    texts = read_documents()
    requests = tokens = 0
    with TokenizerClient(url, api_key=api_key) as client:
        for start in range(0, len(texts), BATCH):
            batch = texts[start : start + BATCH]
            got = [row.tolist() for row in client.tokenize(batch, model=name)]
            assert got == processor.encode(batch), f"ids differ in paragraphs {start}..{start + len(batch)}"
            requests += 1
            tokens += sum(len(row) for row in got)
        batch = texts[:BATCH]
        got = [row.tolist() for row in client.tokenize(batch, model=name, add_bos=True, add_eos=True, format="json")]
        assert got == processor.encode(batch, add_bos=True, add_eos=True), "ids differ with add_bos/add_eos (JSON)"
        requests += 1
        tokens += sum(len(row) for row in got)

    samples = sample_values(url)
    counted = samples[("tokenizer_requests_total", (("endpoint", "/v1/tokenize"), ("status", "200")))]
    assert counted == requests, f"tokenizer_requests_total counted {counted} tokenize requests, sent {requests}"
    counted = samples[("tokenizer_tokens_total", (("model", name),))]
    assert counted == tokens, f"tokenizer_tokens_total is {counted}, tokenized {tokens}"
    print(
        f"  {len(texts)} documents of tests/data/botchan.txt, {tokens} tokens of {name!r} in {requests} requests:"
        " identical to sentencepiece"
    )


PROMOTION_SECONDS = 600


def promoted(url: str, name: str, headers: dict[str, str]) -> dict[str, object]:
    """The model's /v1/models entry once its fast encoder's gate has passed: a new model is served by its reference
    library while the gate's scan runs beside the workers (minutes in a container on 2 cores), then promoted."""
    import time

    deadline = time.monotonic() + PROMOTION_SECONDS
    while True:
        models = httpx.get(f"{url}/v1/models", headers=headers, timeout=10).json()["models"]
        entry = next(m for m in models if m["name"] == name)
        if entry["encoder"] != entry["library"] or time.monotonic() > deadline:
            return entry
        time.sleep(1)


def check_library_models(url: str, models: list[str], api_key: str | None) -> None:
    from tests.conftest import read_multilingual
    from tests.test_libraries import Reference
    from tokenizer_service.core.models import find_model_files

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    served = {m["name"]: m for m in httpx.get(f"{url}/v1/models", headers=headers, timeout=10).json()["models"]}
    texts = read_multilingual()
    with TokenizerClient(url, api_key=api_key) as client:
        for spec in models:
            name, _, path = spec.partition("=")
            files = find_model_files(name, Path(path))
            entry = served[name]
            assert entry["sha256"] == files.sha256, (entry, files.sha256)
            assert entry["library"] == files.library, entry
            entry = promoted(url, name, headers)
            # a fast encoder (fastokens, gigatoken, or one of them on converted ranks) passed the gate
            assert entry["encoder"].split("(")[0] in ("fastokens", "gigatoken"), entry
            reference = Reference(Path(path))
            got = [row.tolist() for row in client.tokenize(texts, model=name)]
            assert got == [reference.encode(text) for text in texts], f"{name}: ids differ from {files.library}"
            print(f"  {len(texts)} multilingual documents through {name!r} ({files.library}): identical to the library")
            if files.template is not None:
                check_conversations(client, name, Path(path), texts)


def check_conversations(client: TokenizerClient, name: str, snapshot: Path, texts: list[str]) -> None:
    """A snapshot's chat_template.jinja served from the models folder: ids and loss masks as transformers gives them."""
    import transformers

    from tokenizer_service.core.models import find_model_files, hf_special_tokens

    files = find_model_files(name, snapshot)
    special = hf_special_tokens(files)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(snapshot / "tokenizer.json"), bos_token=special["bos"], eos_token=special["eos"]
    )
    conversations = [
        [{"role": "user", "content": texts[i][:300]}, {"role": "assistant", "content": texts[i + 1][:300]}]
        for i in range(0, 40, 2)
    ]
    got = client.tokenize_conversations(conversations, model=name)
    for conversation, (ids, mask) in zip(conversations, got, strict=True):
        want = tokenizer.apply_chat_template(
            conversation,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            chat_template=files.template.text,
        )
        assert ids.tolist() == list(want["input_ids"]) and mask.tolist() == list(want["assistant_masks"]), name
    print(f"  {len(conversations)} conversations through {name!r}'s chat_template.jinja: identical to transformers")


def docker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=60, check=False)


def check_container(image: str, service: str) -> None:
    config = json.loads(docker("image", "inspect", "--format", "{{json .Config}}", image).stdout)
    assert config["User"] == IMAGE_USER, f"image user is {config['User']!r}, not {IMAGE_USER}"
    assert "8000/tcp" in config["ExposedPorts"], config["ExposedPorts"]
    test = config["Healthcheck"]["Test"]
    assert test[0] == "CMD", test
    ran = docker("compose", "exec", "-T", service, *test[1:])
    assert ran.returncode == 0, f"the image's HEALTHCHECK failed: {ran.stderr}"

    ids = docker("compose", "exec", "-T", service, "python", "-c", "import os; print(os.getuid(), os.getgid())")
    assert ids.stdout.split() == ["10001", "10001"], f"runs as {ids.stdout!r} {ids.stderr}"
    root = docker("compose", "exec", "-T", service, "python", "-c", "open('/probe', 'w')")
    assert root.returncode != 0 and "Read-only file system" in root.stderr, f"root is writable: {root.stderr}"
    tmp = docker("compose", "exec", "-T", service, "python", "-c", "open('/tmp/probe', 'w').write('x')")
    assert tmp.returncode == 0, f"/tmp is not writable: {tmp.stderr}"
    print(f"  HEALTHCHECK passes; runs as {IMAGE_USER}; root read-only, /tmp writable")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", help="NAME=PATH of the one model the container should serve")
    parser.add_argument("--library-model", action="append", default=[], help="NAME=PATH of a tokenizer.json/tiktoken")
    parser.add_argument("--api-key", help="the container wants API keys: check 401 without, use this one")
    parser.add_argument("--inspect", metavar="IMAGE")
    parser.add_argument("--service", default="tokenizer")
    args = parser.parse_args()
    if args.model:
        name, _, path = args.model.partition("=")
        check_tokenize(args.url, name, Path(path), args.api_key)
    if args.library_model:
        check_library_models(args.url, args.library_model, args.api_key)
    if args.inspect:
        check_container(args.inspect, args.service)


if __name__ == "__main__":
    try:
        main()
    except AssertionError as exc:
        sys.exit(f"docker e2e check failed: {exc}")
