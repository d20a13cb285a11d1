"""Copy TRL's catalogue of chat templates into app/core/catalogue/ (run after bumping trl in pyproject's test extra).

TRL (Apache-2.0) keeps the chat templates models ship and, for many, a training version with `{% generation %}`
marks (`trl/chat_templates/<name>.jinja` and `<name>_training.jinja`; `trl.chat_template_utils.
get_training_chat_template` matches a model's template by its exact text). The server cannot depend on trl itself
(it pulls torch through accelerate), so the pairs are vendored here, byte for byte, with the version they came
from; tests/test_chat.py checks them against the installed trl when it is there.

    pip install 'trl==VERSION' && python scripts/vendor_trl_catalogue.py
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
from pathlib import Path

DESTINATION = Path(__file__).resolve().parent.parent / "app" / "core" / "catalogue"


def main() -> None:
    spec = importlib.util.find_spec("trl")  # the package's folder, without importing it (and torch)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("trl is not installed: pip install trl")
    source = Path(next(iter(spec.submodule_search_locations))) / "chat_templates"
    version = importlib.metadata.version("trl")
    for old in DESTINATION.glob("*.jinja"):
        old.unlink()
    DESTINATION.mkdir(parents=True, exist_ok=True)
    pairs = 0
    for training in sorted(source.glob("*_training.jinja")):
        stock = training.with_name(training.name.removesuffix("_training.jinja") + ".jinja")
        if stock.is_file():
            shutil.copyfile(stock, DESTINATION / stock.name)
            shutil.copyfile(training, DESTINATION / training.name)
            pairs += 1
    (DESTINATION / "VERSION").write_text(f"trl=={version}\n")
    print(f"{pairs} template pairs from trl {version} in {DESTINATION}")


if __name__ == "__main__":
    main()
