# The Python worker of ares-runner (ares-runner/src/reward/python.rs): imports a reward
# function written for EasyR1's interface and answers batches, and feeds the experiment
# loggers (wandb, tensorboard, swanlab, mlflow) through their own packages, over JSON lines.
#
# argv: <file.py | -> <function name> <reward_type: batch | sequential | auto>
# stdin, first line: {"kwargs": {...}, "loggers": null | {"names": [...], "project": ...,
#   "experiment": ..., "config": {...}, "run_dir": ..., "wandb_run_id": null}}; then one
#   line per call: {"inputs": [...]}, {"log": {...}, "step": n},
#   {"generations": [[prompt, response, ground_truth, score], ...], "step": n}, {"finish": true}.
# stdout, one line per message:
#   {"ready": true, "reward_type": "batch" | "sequential" | null, "loggers": [...]}
#   {"scores": [{"overall": 1.0, ...}, ...]}   {"logged": true}   {"finished": true}
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


class Wandb:
    def __init__(self, s):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=s["project"],
            name=s["experiment"],
            config=s["config"],
            dir=s["run_dir"],
            id=s.get("wandb_run_id"),
            resume="allow" if s.get("wandb_run_id") else None,
        )

    def log(self, data, step):
        self.run.log(data, step=step)

    def generations(self, rows, step):
        table = self.wandb.Table(columns=["prompt", "response", "ground_truth", "score"], data=rows)
        self.run.log({"val/generations": table}, step=step)

    def finish(self):
        self.run.finish()


class Tensorboard:
    def __init__(self, s):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            from tensorboardX import SummaryWriter
        root = os.environ.get("TENSORBOARD_DIR") or os.path.join(s["run_dir"], "tensorboard")
        self.writer = SummaryWriter(os.path.join(root, s["project"], s["experiment"]))

    def log(self, data, step):
        for key, value in data.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def generations(self, rows, step):
        text = "\n\n".join(f"**prompt** {p}\n\n**response** {r}\n\n**ground truth** {g}, score {s}" for p, r, g, s in rows)
        self.writer.add_text("val/generations", text, step)

    def finish(self):
        self.writer.close()


class Swanlab:
    def __init__(self, s):
        import swanlab

        self.swanlab = swanlab
        swanlab.init(
            project=s["project"],
            experiment_name=s["experiment"],
            config=s["config"],
            logdir=os.environ.get("SWANLAB_DIR") or os.path.join(s["run_dir"], "swanlog"),
            mode=os.environ.get("SWANLAB_MODE") or "cloud",
        )

    def log(self, data, step):
        self.swanlab.log(data, step=step)

    def generations(self, rows, step):
        texts = [self.swanlab.Text(f"{p}\n---\n{r}\n---\n{g} ({s})") for p, r, g, s in rows]
        self.swanlab.log({"val/generations": texts}, step=step)

    def finish(self):
        self.swanlab.finish()


class Mlflow:
    def __init__(self, s):
        import mlflow

        self.mlflow = mlflow
        mlflow.set_experiment(s["project"])
        mlflow.start_run(run_name=s["experiment"])
        flat = {}

        def walk(prefix, node):
            if isinstance(node, dict):
                for k, v in node.items():
                    walk(f"{prefix}.{k}" if prefix else str(k), v)
            else:
                flat[prefix] = node

        walk("", s["config"])
        mlflow.log_params({k: str(v)[:250] for k, v in flat.items()})

    def log(self, data, step):
        self.mlflow.log_metrics({k.replace("@", "_at_"): v for k, v in data.items()}, step=step)

    def generations(self, rows, step):
        text = "\n\n".join(f"{p}\n---\n{r}\n---\n{g} ({s})" for p, r, g, s in rows)
        self.mlflow.log_text(text, f"val_generations_step_{step}.txt")

    def finish(self):
        self.mlflow.end_run()


LOGGERS = {"wandb": Wandb, "tensorboard": Tensorboard, "swanlab": Swanlab, "mlflow": Mlflow}
PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard (with torch or tensorboardX)", "swanlab": "swanlab", "mlflow": "mlflow"}


def open_loggers(setup):
    opened = []
    for name in (setup or {}).get("names", []):
        try:
            opened.append((name, LOGGERS[name](setup)))
        except BaseException as e:
            fail(
                f"logger {name}: {type(e).__name__}: {e} (install {PACKAGES[name]} in this Python, "
                f"or take `{name}` out of trainer.logger)",
                tb=traceback.format_exc(),
            )
            return None
    return opened


def main():
    path, name, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    hello = json.loads(sys.stdin.readline() or "{}")
    kwargs = hello.get("kwargs") or {}
    function = None
    if path != "-":
        try:
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
    loggers = open_loggers(hello.get("loggers"))
    if loggers is None:
        return
    send({"ready": True, "reward_type": mode if function else None, "loggers": [n for n, _ in loggers]})
    for line in sys.stdin:
        if not line.strip():
            continue
        message = json.loads(line)
        if "finish" in message:
            for name, logger in loggers:
                try:
                    logger.finish()
                except BaseException as e:
                    print(f"ares-runner: logger {name}: finishing raised {type(e).__name__}: {e}", file=sys.stderr)
            send({"finished": True})
            return
        if "log" in message or "generations" in message:
            for name, logger in loggers:
                try:
                    if "log" in message:
                        logger.log(message["log"], message["step"])
                    else:
                        logger.generations(message["generations"], message["step"])
                except BaseException as e:
                    fail(f"logger {name} raised {type(e).__name__}: {e}", tb=traceback.format_exc())
                    break
            else:
                send({"logged": True})
            continue
        inputs = message["inputs"]
        if function is None:
            fail("no reward function was loaded")
            continue
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
    for _, logger in loggers:
        logger.finish()


main()
