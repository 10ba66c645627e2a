"""Where the tests find the project: its root and the profile shipped inside the package (every test
that plans on it runs on a fresh clone)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPT_6_7B_A100 = ROOT / "megatron_dynapipe" / "planning" / "profiles" / "gpt-6.7b-a100.json"
