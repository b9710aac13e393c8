"""The ``vlfit`` command: dispatches ``vlfit <command> [flags]`` to one module per command."""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "make-data": ("vlfit.commands.make_data", "write a synthetic New-Yorker-like captioned dataset"),
    "train": ("vlfit.commands.train", "fine-tune BridgeTower contrastively (every TrainingArguments flag works)"),
    "prepare": ("vlfit.commands.prepare", "re-encode images at training resolution into parquet shards (resumable)"),
    "eval": ("vlfit.commands.evaluate", "text<->image recall@1/5/10 and matching accuracy on a split"),
    "demo": ("vlfit.commands.demo", "make data, fine-tune the small preset on the CPU, evaluate, summarize"),
    "bench": ("vlfit.commands.bench", "input-pipeline throughput sweep: the bottleneck and the settings to use"),
}


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: vlfit <command> [flags]   (vlfit <command> --help for its flags)", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_text}" for name, (_, help_text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run ``vlfit <command>``; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"vlfit: unknown command {command!r}; choose one of: {', '.join(COMMANDS)}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    code = int(module.main(rest) or 0)
    # A process group left to interpreter exit can abort the process after its work is done (gloo's worker threads
    # outlive the interpreter: SIGABRT, pytorch#190489). Only after a normal return: a process that raised may
    # have peers still inside a collective, which destroying the group could hang.
    dist = sys.modules.get("torch.distributed")  # not imported: no process group to close
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
