"""``atb-mem serve`` as a user runs it: a process that answers, then stops cleanly on Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from tests.support.models import save_tiny_checkpoint
from tests.support.processes import free_port, wait_until_healthy


def replayed_events(endpoint: str) -> bytes:
    """Every KV-event batch the server still buffers, asked for on its replay socket."""
    import zmq

    context = zmq.Context()
    try:
        socket = context.socket(zmq.DEALER)
        socket.connect(endpoint)
        socket.send_multipart([b"", (0).to_bytes(8, "big")])
        payloads = b""
        while socket.poll(30_000):
            _, seq, payload = socket.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                return payloads
            payloads += payload
        raise AssertionError("the replay never ended")
    finally:
        context.destroy(linger=0)


def test_serve_answers_and_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    import httpx

    save_tiny_checkpoint(tmp_path)
    config = tmp_path / "serve.json"
    config.write_text('{"max_num_seqs": 5, "watermark": 0.02}')
    port, replay_port = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "atb_mem", "serve", str(tmp_path), "--port", str(port),
         "--device", "cpu", "--num-blocks", "64", "--served-model-name", "tiny",
         "--kv-offload", "host=1MiB", "--kv-offload", f"disk={tmp_path / 'disk'}:16MiB",
         "--eviction-policy", "slru", "--kv-identity", "tiny@test",
         "--config", str(config), "--kv-events-endpoint", "tcp://127.0.0.1:*",
         "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay_port}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_healthy(process, port, 120)
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                              json={"model": "tiny", "prompt": "hello " * 40, "max_tokens": 4},
                              timeout=60)
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] >= 1
        settings = httpx.get(f"http://127.0.0.1:{port}/admin/config").json()["config"]
        assert (settings["max_num_seqs"], settings["watermark"]) == (5, 0.02)  # the file's
        assert b"BlockStored" in replayed_events(f"tcp://127.0.0.1:{replay_port}")
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err
    assert "Traceback" not in err
    assert f"serving 'tiny' on http://127.0.0.1:{port}" in out
    assert "KV blocks of 16 tokens, " in out and " on the host)" in out, out
    assert (tmp_path / "disk").is_dir(), "the disk tier's directory is made at start-up"
    assert out.rstrip().endswith("atb-mem: stopped")


def refusal(checkpoint: Path, *options: str) -> str:
    """The one line ``atb-mem serve`` exits 1 with, for a checkpoint and bad options."""
    result = subprocess.run([sys.executable, "-m", "atb_mem", "serve", str(checkpoint),
                             "--device", "cpu", "--num-blocks", "64", *options],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]  # after transformers' loading bar
    assert last.startswith("atb-mem: error:"), last
    return last


def test_serve_refuses_a_bad_config_file_in_one_line(tmp_path: Path) -> None:
    save_tiny_checkpoint(tmp_path)
    config = tmp_path / "serve.json"
    config.write_text('{"max_num_seqs": 0}')
    assert "max_num_seqs" in refusal(tmp_path, "--config", str(config))


def test_serve_starts_its_own_tensor_parallel_ranks(tmp_path: Path) -> None:
    import httpx

    from atb_mem.serving import Engine, SamplingParams

    save_tiny_checkpoint(tmp_path)
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "atb_mem", "serve", str(tmp_path), "--port", str(port),
         "--device", "cpu", "--num-blocks", "64", "--served-model-name", "tiny",
         "--tensor-parallel-size", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    prompt = "hello " * 12
    try:
        wait_until_healthy(process, port, 180)
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True})
        assert response.status_code == 200, response.text
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err
    assert "Traceback" not in err and out.rstrip().endswith("atb-mem: stopped")
    [expected] = Engine.from_pretrained(str(tmp_path), device="cpu", num_blocks=64).generate(
        prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert response.json()["choices"][0]["text"] == expected.outputs[0].text


def test_serve_refuses_an_unknown_offload_tier_in_one_line(tmp_path: Path) -> None:
    save_tiny_checkpoint(tmp_path)
    assert "unknown tiers ['tape']" in refusal(tmp_path, "--kv-offload", "tape=1GiB")


def test_serve_refuses_an_empty_kv_identity_in_one_line(tmp_path: Path) -> None:
    save_tiny_checkpoint(tmp_path)
    assert "kv_identity" in refusal(tmp_path, "--kv-offload", f"disk={tmp_path / 'disk'}:16MiB",
                                    "--kv-identity", " ")


def test_serve_keeps_a_hybrid_models_states_for_prefix_hits(tmp_path: Path) -> None:
    """A Granite 4.0-H checkpoint (Mamba2 layers) served with --state-checkpoint-interval:
    the same prompt asked twice is a prefix hit the second time (its states resume from a
    checkpoint), as /metrics says."""
    import httpx

    save_tiny_checkpoint(tmp_path, "granitemoehybrid")
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "atb_mem", "serve", str(tmp_path), "--port", str(port),
         "--device", "cpu", "--num-blocks", "256", "--block-size", "4",
         "--served-model-name", "tiny", "--state-checkpoint-interval", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_healthy(process, port, 120)
        for _ in range(2):
            response = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                                  json={"model": "tiny", "prompt": "hello world " * 6,
                                        "max_tokens": 3}, timeout=60)
            assert response.status_code == 200, response.text
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        hits = [line for line in metrics.splitlines()
                if line.startswith("atb_mem_kv_cache_prefix_cache_hits")]
        assert hits and float(hits[0].split()[-1]) > 0, hits
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err
    bad = subprocess.run([sys.executable, "-m", "atb_mem", "serve", str(tmp_path),
                          "--state-checkpoint-interval", "0"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 2 and "--state-checkpoint-interval" in bad.stderr
