"""The two hooks of a data-format module, made once for its one :class:`plait.data.prepare.DataFormat`."""

from plait import hookimpl
from plait.data.prepare import DataFormat


def format_hooks(data_format: DataFormat, **detect_order):
    """``register_data_formats`` and ``detect_data_format`` for ``data_format``, to assign under
    those names in the module. ``detect_order`` is pluggy's ``tryfirst=True`` (a shape that
    contains another's columns) or ``trylast=True`` (a shape every other contains)."""

    @hookimpl
    def register_data_formats(register):
        register(data_format.name, data_format, doc=data_format.doc)

    @hookimpl(**detect_order)
    def detect_data_format(columns):
        return data_format.detect(columns)

    return register_data_formats, detect_data_format
