"""``atb-mem generate MODEL_DIR --prompt TEXT``: a quick look at a model served by atb-mem,
its tokens streamed to the terminal as they are sampled."""

from __future__ import annotations

import click

from atb_mem.tools.options import console, engine_options


@click.command()
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--prompt", required=True, help="Text to continue.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="0 is greedy.")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0,
              show_default=True)
@click.option("--top-k", type=click.IntRange(min=-1), default=-1, show_default=True)
@click.option("--seed", type=click.IntRange(min=0), default=None)
@engine_options
def generate(model_dir: str, prompt: str, max_tokens: int, temperature: float, top_p: float,
             top_k: int, seed: int | None, device: str | None, dtype: str, block_size: int,
             num_blocks: int | None, attention_backend: str, kv_cache_dtype: str) -> None:
    """Continues PROMPT with the checkpoint in MODEL_DIR, streaming the text."""
    from atb_mem.serving import Engine, SamplingParams

    engine = Engine.from_pretrained(model_dir, device=device,
                                    dtype=None if dtype == "auto" else dtype,
                                    block_size=block_size, num_blocks=num_blocks, max_num_seqs=1,
                                    attention_backend=attention_backend,
                                    kv_cache_dtype=kv_cache_dtype)
    if engine.tokenizer is None:
        raise click.ClickException(f"{model_dir} has no tokenizer to read the prompt with")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            top_k=top_k, seed=seed)
    engine.add_request("cli", prompt, params)
    reason = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            for completion in output.outputs:
                console.out(completion.text, end="", highlight=False)
                reason = completion.finish_reason or reason
    console.out("", highlight=False)
    console.print(f"[dim]finished: {reason}[/dim]")
