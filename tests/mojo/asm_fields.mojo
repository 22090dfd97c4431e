"""Reading AMDGPU assembly in the Mojo tests: the kernel descriptor's fields."""

from std.testing import assert_true


def amdhsa_field(asm: String, name: StaticString) raises -> Int:
    """The value of the first `.amdhsa_<name>` line of `asm`.

    Raises:
        Error: If there is no such line.
    """
    var key = String(".amdhsa_", name, " ")
    var at = asm.find(key)
    assert_true(at >= 0, String("no ", key))
    var rest = asm[byte = at + key.byte_length() :]
    var end = rest.find("\n")
    return Int(rest[byte=0:end].strip())
