"""``declattn show``: a picture and a web page of one DA response, from its run record.

``record`` builds and saves the run record; ``view`` reads it back into small typed
dataclasses (one reading for both renderers); ``figure`` draws the PNG and ``page`` the
HTML; ``files`` writes both for a record file.
"""

from declattn.show.files import ShowFiles, load_show_record, write_show
from declattn.show.view import ShowRecord

__all__ = ["ShowFiles", "ShowRecord", "load_show_record", "write_show"]
