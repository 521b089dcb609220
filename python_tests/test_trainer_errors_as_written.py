"""A bad value's error names what the user wrote (issue 37 item 11): the recipe key and file for a --config
file's value, the flag as typed for the command line's, never our spelling of a setting the user did not write."""
import pytest

from rlkernels.trainer.run_config import from_args


def _error(argv):
    with pytest.raises(ValueError) as e:
        from_args(argv)
    return str(e.value)


def test_recipe_key_is_named_with_its_file(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("max_completion_length: -1\nlearning_rate: 5.0\n")
    message = _error(["--config", str(recipe), "--lr", "1e-5"])
    assert message.startswith(f"max_completion_length in --config {recipe}, flag --max-new-tokens:")
    own = tmp_path / "own.json"
    own.write_text('{"seed": -1}')
    assert _error(["--config", str(own)]).startswith(f"seed in --config {own}, flag --seed:")


def test_command_line_flag_is_named_as_typed(tmp_path):
    assert _error(["--max-completion-length", "-1"]).startswith("--max-completion-length:")
    assert _error(["--learning_rate=5"]).startswith("--learning_rate:")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("max_completion_length: 16\n")  # the flag wins over the file, and is the one named
    assert _error(["--config", str(recipe), "--max-new-tokens", "0"]).startswith("--max-new-tokens:")
