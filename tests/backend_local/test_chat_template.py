import pytest

from gateway.backends.chat_template import render_chat


def test_gemma_turns_with_system_folded_into_first_user_turn():
    messages = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Sky colour?"},
        {"role": "assistant", "content": "Blue."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Grass"}, {"type": "text", "text": "?"}],
        },
    ]
    text = render_chat(messages, None, "gemma3", bos_token="<bos>")
    assert text == (
        "<bos><start_of_turn>user\nAnswer in one word.\n\nSky colour?<end_of_turn>\n"
        "<start_of_turn>model\nBlue.<end_of_turn>\n"
        "<start_of_turn>user\nGrass?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


def test_gemma_without_generation_prompt_and_without_system():
    text = render_chat(
        [{"role": "user", "content": " hi "}], None, "gemma", add_generation_prompt=False
    )
    assert text == "<start_of_turn>user\nhi<end_of_turn>\n"


def test_gemma_rejects_turns_that_do_not_alternate():
    with pytest.raises(ValueError, match="alternate"):
        render_chat([{"role": "assistant", "content": "x"}], None, "gemma3")


def test_chatml_for_qwen():
    text = render_chat([{"role": "user", "content": "hi"}], None, "qwen3")
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_model_template_wins_over_builtin():
    template = "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}{{ eos_token }}"
    text = render_chat([{"role": "user", "content": "a"}], template, "gemma3", eos_token="</s>")
    assert text == "[user:a]</s>"


def test_unknown_architecture_without_template_is_a_clear_error():
    with pytest.raises(ValueError, match="no chat template.*'mamba'"):
        render_chat([{"role": "user", "content": "a"}], None, "mamba")


def test_template_raise_exception_becomes_value_error():
    template = "{{ raise_exception('no system messages please') }}"
    with pytest.raises(ValueError, match="no system messages please"):
        render_chat([{"role": "user", "content": "a"}], template, "x")


def test_template_cannot_reach_python_internals():
    template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ValueError, match="unsafe"):
        render_chat([{"role": "user", "content": "a"}], template, "x")


def test_non_text_parts_are_rejected():
    message = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    with pytest.raises(ValueError, match="image_url"):
        render_chat([message], None, "gemma3")
