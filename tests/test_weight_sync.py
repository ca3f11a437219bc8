"""Weight sync into a real `arbor serve`: buckets, version, cache flush, logprob gap."""

import asyncio

import pytest
import torch
from tiny_model import build_tiny_model_dir
from transformers import AutoModelForCausalLM

from arbor.engines.client import SGLangClient
from arbor.engines.launch import launch_engines
from arbor.run.weight_sync import WeightSync, behind, probe_logprob_gap
from arbor.train.weight_sync import gathered_parameters, named_tensor_buckets


@pytest.mark.parametrize(("label", "version", "expected"), [
    ("default", "2", True),  # model.path's weights on a server restarted after push 2
    ("1", "2", True), ("9", "10", True),  # by number, not as text
    ("2", "2", False), ("3", "2", False),  # a push landed while the call ran
    ("default", None, False), ("1", None, False),  # nothing pushed yet
    ("default", "default", False),
    ("v2", "3", False), ("1", "latest", False),  # labels that do not order
])
def test_an_answer_is_behind_only_when_its_weights_predate_the_push_it_was_sent_under(label, version, expected):
    assert behind(label, version) is expected


def test_buckets_respect_the_size_bound():
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([100, 100, 300, 50, 10])]  # float32
    buckets = list(named_tensor_buckets(iter(tensors), bucket_mb=800 / 2**20))  # 800 bytes
    # 400 + 400 bytes fit; t2 (1200 bytes) goes alone; t3 + t4 (240 bytes) together.
    assert [[name for name, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3", "t4"]]
    buckets = list(named_tensor_buckets(iter(tensors), bucket_mb=1))
    assert len(buckets) == 1 and len(buckets[0]) == 5


def test_sync_to_arbor_serve(tmp_path):
    path = build_tiny_model_dir(tmp_path / "tiny")
    learner = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():  # the learner's weights move away from the engine's
        for p in learner.parameters():
            p.add_(0.05 * torch.randn_like(p))
    prompts = [[5, 6, 7], [9, 10, 11, 12]]

    async def main(url):
        async with SGLangClient([url]) as client:
            before = await probe_logprob_gap(client, learner, prompts)
            sync = WeightSync(client)
            # Small buckets: several broadcasts, the cache flushed and the version set once.
            await sync.push(named_tensor_buckets(gathered_parameters(learner, 0), bucket_mb=0.05), "1")
            after = await probe_logprob_gap(client, learner, prompts)
            # Disk transport: the engine loads an HF directory the learner wrote.
            with torch.no_grad():
                for p in learner.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            learner.save_pretrained(tmp_path / "export")
            disk = WeightSync(client)
            await disk.push_directory(tmp_path / "export", "2")
            after_disk = await probe_logprob_gap(client, learner, prompts)
            return before, after, after_disk, await client.get_weight_version()

    with launch_engines("embedded", model_path=str(path), log_dir=tmp_path / "logs") as handle:
        before, after, after_disk, versions = asyncio.run(main(handle.urls[0]))
    assert before > 1e-2
    assert after <= 1e-4 and after_disk <= 1e-4
    assert versions == ["2"]


def test_version_mismatch_is_an_error(tmp_path):
    path = build_tiny_model_dir(tmp_path / "tiny")

    async def main(url):
        async with SGLangClient([url]) as client:
            await WeightSync(client).check_version("not-this")

    with launch_engines("embedded", model_path=str(path), log_dir=tmp_path / "logs") as handle:
        with pytest.raises(RuntimeError, match="weight sync to version 'not-this' failed"):
            asyncio.run(main(handle.urls[0]))
