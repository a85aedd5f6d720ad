"""Language, termination and looping checks on fixtures (langid runs offline)."""

import pytest

from chatfleet.gate.reply_checks import check_reply, detect_language, is_looping, language_mismatch, script_share


@pytest.mark.parametrize("text, lang", [
    ("The old knight walks slowly to the castle and smiles at the guards.", "en"),
    ("El viejo caballero camina despacio hacia el castillo y sonríe a los guardias.", "es"),
    ("Der alte Ritter geht langsam zur Burg und lächelt die Wachen an.", "de"),
    ("Старый рыцарь медленно идёт к замку и улыбается стражникам.", "ru"),
])
def test_language_id_knows_the_workload_languages(text, lang):
    assert detect_language(text) == lang
    assert language_mismatch(text, lang) == (False, lang)


def test_mismatches_by_script_and_by_language_id():
    assert script_share("Привет, мир", "CYRILLIC") == 1.0
    assert language_mismatch("Hello there, my friend, how are you?", "ru")[0]  # wrong script
    assert language_mismatch("The old knight walks slowly to the castle and smiles.", "es") == (True, "en")
    assert language_mismatch("12345 !!!", "en")[0]  # no letters at all
    assert language_mismatch("Hola", "es") == (False, None)  # too short for language id: script only


def test_looping_on_token_ids_and_termination():
    assert is_looping([1, 2, 3, 4] * 6)
    assert not is_looping(list(range(40)))
    assert not is_looping([7, 8] * 3)  # too short to judge
    fails = check_reply("Der alte Ritter geht langsam zur Burg und lächelt.", [5, 6, 7], "length", "de")
    assert fails.hit_max_tokens and not fails.looping and not fails.language_mismatch
    assert not check_reply("Der alte Ritter geht langsam zur Burg.", [5], "stop", "de").hit_max_tokens
