# The reward worker of ares-runner (ares-runner/src/reward/python.rs): imports one Python
# reward function written for EasyR1's interface and answers batches over JSON lines.
#
# argv: <file.py> <function name> <reward_type: batch | sequential | auto>
# stdin, first line: {"kwargs": {...}}; then one line per call: {"inputs": [{...}, ...]}.
# stdout, one line per message:
#   {"ready": true, "reward_type": "batch" | "sequential"}
#   {"scores": [{"overall": 1.0, ...}, ...]}
#   {"error": "...", "traceback": "...", "index": i | null}
# The user's own prints go to stderr: stdout belongs to the protocol.
import importlib.util
import json
import math
import os
import sys
import traceback

proto = os.fdopen(os.dup(1), "w", encoding="utf-8")
os.dup2(2, 1)
sys.stdout = sys.stderr


def send(message):
    proto.write(json.dumps(message, allow_nan=False) + "\n")
    proto.flush()


def fail(error, index=None, tb=None):
    send({"error": error, "traceback": tb or "", "index": index})


def number(value):
    """A JSON number from a Python or numpy scalar, or None when it is not one."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", 0) == 0:
        try:
            return number(item())
        except Exception:
            return None
    return None


def check_score(score, index):
    """The score dict as {name: float}, or an error message naming what is wrong."""
    if not isinstance(score, dict):
        return None, f"returned {type(score).__name__}, expected a dict with an 'overall' key"
    if "overall" not in score:
        keys = ", ".join(map(str, score)) or "none"
        return None, f"the returned dict has no 'overall' key (keys: {keys})"
    out = {}
    for key, value in score.items():
        x = number(value)
        if x is None:
            return None, f"'{key}' is {type(value).__name__} {value!r:.80}, expected a number"
        if not math.isfinite(x):
            return None, f"'{key}' is {x}, expected a finite number"
        out[str(key)] = x
    return out, None


def main():
    path, name, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    try:
        hello = json.loads(sys.stdin.readline() or "{}")
        kwargs = hello.get("kwargs") or {}
        directory = os.path.dirname(os.path.abspath(path))
        if directory not in sys.path:
            sys.path.insert(0, directory)
        spec = importlib.util.spec_from_file_location("ares_reward_function", path)
        if spec is None or spec.loader is None:
            fail(f"{path} cannot be imported as a Python module")
            return
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except BaseException as e:
        fail(f"importing {path} raised {type(e).__name__}: {e}", tb=traceback.format_exc())
        return
    function = getattr(module, name, None)
    if not callable(function):
        names = [n for n in dir(module) if callable(getattr(module, n)) and not n.startswith("_")]
        fail(f"{path} has no function '{name}' (its functions: {', '.join(names) or 'none'})")
        return
    if mode == "auto":
        mode = getattr(module, "REWARD_TYPE", "batch")
    if mode not in ("batch", "sequential"):
        fail(f"{path}: REWARD_TYPE = {mode!r}; expected 'batch' or 'sequential'")
        return
    send({"ready": True, "reward_type": mode})
    for line in sys.stdin:
        if not line.strip():
            continue
        inputs = json.loads(line)["inputs"]
        index = None
        try:
            if mode == "batch":
                scores = function(inputs, **kwargs)
                if not isinstance(scores, (list, tuple)):
                    fail(f"returned {type(scores).__name__}, expected a list of dicts (one per response)")
                    continue
                if len(scores) != len(inputs):
                    fail(f"returned {len(scores)} scores for {len(inputs)} responses")
                    continue
            else:
                scores = []
                for index, one in enumerate(inputs):
                    scores.append(function(one, **kwargs))
                index = None
        except BaseException as e:
            fail(f"raised {type(e).__name__}: {e}", index=index, tb=traceback.format_exc())
            continue
        checked = []
        for i, score in enumerate(scores):
            out, error = check_score(score, i)
            if error is not None:
                fail(error, index=i)
                break
            checked.append(out)
        else:
            send({"scores": checked})


main()
