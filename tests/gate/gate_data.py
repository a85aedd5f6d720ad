"""Where the tests find GSM8K: ``../shared/data/gsm8k`` beside the repository (as CI lays it out),
or CHATFLEET_GSM8K_DIR. Imported by name (tests/gate is on sys.path)."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GSM8K_DIR = Path(os.environ.get("CHATFLEET_GSM8K_DIR", REPO.parent / "shared" / "data" / "gsm8k"))
GSM8K_TEST = GSM8K_DIR / "test.jsonl"
GSM8K_FEWSHOT = GSM8K_DIR / "train_head50.jsonl"
