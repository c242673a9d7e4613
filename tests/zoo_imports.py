"""Import torchvision (and with it transformers, whose image utilities import it) in the test
venv, where torchvision 0.28 is a CUDA build paired with a CPU torch: its
``torchvision/_meta_registrations.py`` registers fake kernels for its C++ ops
(``torchvision::nms``, ``roi_align`` ...), which do not exist in this torch, and the import fails
with "operator torchvision::nms does not exist". The model constructors the tests use need none
of those ops, so when (and only when) that import fails, an empty module stands in for
``torchvision._meta_registrations`` and the import is retried. A torchvision that imports
cleanly is left alone."""
import sys
import types


def import_torchvision():
    """``torchvision`` (in the ``test`` extra: an ImportError is a broken install, raised)."""
    try:
        import torchvision
        return torchvision
    except RuntimeError as e:
        if "torchvision::" not in str(e):
            raise
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]
    sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
    import torchvision
    return torchvision


import_torchvision()
