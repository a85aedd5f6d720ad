import pytest

from chatfleet.errors import ConfigError
from chatfleet.registry import Registry


def test_register_make_and_unknown_names_list_valid_ones():
    reg: Registry[object] = Registry("widget")

    @reg.register("b")
    class B:
        def __init__(self, x=0):
            self.x = x

    reg.register("a")(lambda: "a")
    assert reg.names == ["a", "b"] and "b" in reg
    assert reg.make("b", x=3).x == 3
    with pytest.raises(ConfigError, match=r"unknown widget 'c'; valid: a, b"):
        reg.make("c")
    with pytest.raises(ConfigError, match="twice"):
        reg.register("a")(lambda: None)
