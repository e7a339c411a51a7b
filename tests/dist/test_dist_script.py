"""course_lib.dist.script, the labs' run.py frame: options with --trace, init, the traced body, shutdown.

One process started as a launcher starts a rank (RANK, WORLD_SIZE, MASTER_* in its environment) runs
a script written the way the labs' run.py are, with a module beside it; the labs' own scripts run
under accelerate launch in tests/labs/test_labs.py.
"""

import json
import os
import subprocess
import sys

from course_lib.dist import script

SCRIPT = '''"""A script in the labs' frame: its body, its options, nothing else."""
import torch.distributed as dist
from beside import WORD

from course_lib.dist import script


def run(args):
    say = script.print_on(0)
    say(f"{WORD} on {dist.get_world_size()} rank, n={args.n}")
    return args.stop


def main():
    parser = script.parser(__doc__)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--stop")
    script.main(run, parser)


if __name__ == "__main__":
    main()
'''


def _run(folder, port, *args):
    (folder / "run.py").write_text(SCRIPT)
    (folder / "beside.py").write_text('WORD = "the module beside run.py"\n')
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env["COURSE_BACKEND"] = "gloo"
    cmd = [sys.executable, str(folder / "run.py"), *args]
    return subprocess.run(cmd, cwd=folder.parent, env=env, capture_output=True, text=True, timeout=120)


def test_parser_is_described_by_the_docstring_and_takes_trace():
    parser = script.parser("First line.\n\nMore.")
    assert parser.description == "First line."
    assert parser.parse_args([]).trace is None
    assert parser.parse_args(["--trace", "t.json"]).trace == "t.json"


def test_a_script_imports_its_neighbour_runs_its_body_and_writes_its_trace(tmp_path, free_port):
    out = _run(tmp_path, free_port, "--n", "3", "--trace", str(tmp_path / "trace.json"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == "the module beside run.py on 1 rank, n=3\n"
    events = json.loads((tmp_path / "trace.json").read_text())
    assert events, "--trace writes one Chrome trace of every rank"


def test_a_body_that_returns_a_message_stops_the_script_with_it(tmp_path, free_port):
    out = _run(tmp_path, free_port, "--stop", "not implemented yet")
    assert out.returncode == 1 and "not implemented yet" in out.stderr
    assert not (tmp_path / "trace.json").exists(), "no --trace: nothing recorded"
