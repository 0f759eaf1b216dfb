"""``atb-mem ctl``: the console of a running ``atb-mem serve`` (its ``/admin/config``).

    atb-mem ctl --get
    atb-mem ctl --set max_num_seqs=14 --live [--watch 300s] [--persist]
    atb-mem ctl --set max_num_batched_tokens=4096 --then max_num_seqs=96 --live

Each step is applied at the server's next step boundary and watched by its guard for the
watch period; a step that is rolled back stops the sequence. Values are JSON (``14``,
``0.02``, ``true``) or plain words (``swap``).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import click

from atb_mem.tools.options import write_json

_POLL_S = 0.5


def _setting(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise click.BadParameter(f"{text!r} is not KEY=VALUE")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip(), value


def seconds(text: str) -> float:
    try:
        value = float(text.removesuffix("s"))
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a duration (e.g. 300s)") from None
    if value <= 0:
        raise click.BadParameter("the watch period must be > 0 seconds")
    return value


class AdminClient:
    """``/admin/config`` over HTTP (the standard library: no client extra needed)."""

    def __init__(self, url: str, token: str | None) -> None:
        self.url = url.rstrip("/") + "/admin/config"
        self.token = token

    def call(self, body: dict[str, Any] | None = None) -> dict[str, Any]:
        request = urllib.request.Request(self.url, method="POST" if body else "GET",
                                         data=json.dumps(body).encode() if body else None,
                                         headers={"content-type": "application/json"})
        if self.token:
            request.add_header("authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                answer: dict[str, Any] = json.loads(response.read())
                return answer
        except urllib.error.HTTPError as error:
            try:
                message = json.loads(error.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = str(error)
            raise click.ClickException(f"the server refused ({error.code}): {message}") from None
        except urllib.error.URLError as error:
            raise click.ClickException(f"cannot reach {self.url}: {error.reason}") from None

    def wait_for_decision(self, decisions_before: int) -> dict[str, Any]:
        while True:
            state = self.call()
            if not state["watching"] and len(state["history"]) > decisions_before:
                decision: dict[str, Any] = state["history"][-1]
                return decision
            time.sleep(_POLL_S)


@click.command()
@click.option("--url", default="http://127.0.0.1:8000", show_default=True)
@click.option("--token", envvar="ATB_MEM_ADMIN_TOKEN", default=None,
              help="The server's --admin-token (needed from another host).")
@click.option("--get", "get_", is_flag=True, help="Print the configuration and its history.")
@click.option("--set", "first", multiple=True, metavar="KEY=VALUE",
              help="A setting of the first step (repeatable).")
@click.option("--then", "then", multiple=True, metavar="KEY=VALUE",
              help="A setting applied as its own step once the previous one is kept.")
@click.option("--live", is_flag=True, help="Apply (without it the server only validates).")
@click.option("--watch", "watch", default="300s", show_default=True,
              help="How long the server watches each step before keeping it.")
@click.option("--persist", is_flag=True,
              help="Write kept steps to the config file the server was started with.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def ctl(url: str, token: str | None, get_: bool, first: tuple[str, ...], then: tuple[str, ...],
        live: bool, watch: str, persist: bool, json_path: str | None) -> None:
    """Reads or changes a running server's scheduler configuration, guarded."""
    client = AdminClient(url, token)
    if get_ or not first:
        if then:
            raise click.UsageError("--then follows a --set")
        state = client.call()
        click.echo(json.dumps(state, indent=2))
        write_json(json_path, state)
        return
    watch_s = seconds(watch)
    steps = [dict(_setting(item) for item in first)] + [dict([_setting(item)]) for item in then]
    results: list[dict[str, Any]] = []
    try:
        apply_steps(client, steps, live=live, watch_s=watch_s, persist=persist,
                    results=results)
    finally:
        write_json(json_path, results)


def apply_steps(client: AdminClient, steps: list[dict[str, Any]], *, live: bool,
                watch_s: float, persist: bool, results: list[dict[str, Any]]) -> None:
    """Applies ``steps`` one after the other, each watched to its decision (appended to
    ``results``); a step that is rolled back raises and stops the sequence."""
    for changes in steps:
        before = len(client.call()["history"])
        answer = client.call({"set": changes, "live": live, "watch_s": watch_s,
                              "persist": persist})
        if not live:
            click.echo(f"valid, not applied (add --live): {json.dumps(answer['would_be'])}")
            results.append(answer)
            continue
        click.echo(f"applied {json.dumps(changes)}; watching for {watch_s:g}s ...")
        decision = client.wait_for_decision(before)
        results.append(decision)
        click.echo(f"{decision['outcome']}: {decision['reason']}")
        if decision["outcome"] == "rollback":
            raise click.ClickException(f"{json.dumps(changes)} was rolled back "
                                       f"({decision['reason']}); later steps not applied")
