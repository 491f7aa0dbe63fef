"""verify's own modules: a finished merge's folder judged against what its record makes.

Here live the judging on plain data (`bitwise`, `record_checks`, `published_checks`, `verdict`), a stranger's folder
read safely (`folder_checks`, `loader_files`), the user's copies of recorded inputs (`input_copies`), the Hub
(`hub`), and `verify --sample`: its draw and the bound on what passing it says (`sample`, plain data) and its reads
of the Hub by HTTP ranges into sparse stand-ins (`ranged`). They may import `checks`, `reporting`, `core` and the
shared top-level modules (`errors`, `files`, `session`); never the seam. No merge code imports them: only the CLI's
`verify`, the doors (which read a record) and the seam's verify mode (`verification`, `rerun`, `published`) do
(`tests/test_layout.py`).
"""
