"""``diloco --help`` in a fresh interpreter loads neither the goodput simulation nor matplotlib."""


def test_help_loads_neither_the_simulation_nor_matplotlib():
    import subprocess
    import sys

    probe = (
        "import sys, diloco_cli.cli.app; "
        "print(sorted(m for m in ('matplotlib', 'diloco_cli.simulate', 'torch') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
