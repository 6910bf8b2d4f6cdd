"""The combine rules, one per file: importing this package imports every module in it, so a
rule's class registers itself (:data:`lowcomm.aggregate.combine.COMBINES`) by being here."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
