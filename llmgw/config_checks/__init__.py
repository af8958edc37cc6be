"""
The configuration's checks, which every TOML table uses: each setting
declared once with its kind (L{setting}, L{Kind}: type, range, allowed
values, unit), which both reads the value and describes it; one parser for
every table (L{Table.read}); and the reference printed from the same
declarations (L{llmgw.config_docs}).

  - L{llmgw.config_checks.values}: the grammar of one value (durations,
    sizes, URLs...), L{ConfigError}, and values spelled as TOML writes
    them;
  - L{llmgw.config_checks.kinds}: the kinds keys take;
  - L{llmgw.config_checks.tables}: L{Key}, L{Table}, L{setting}, and the
    one table parser;
  - L{llmgw.config_checks.files}: a file read, and its mistakes told after
    its path.

A leaf: it imports nothing from the rest of llmgw, so any process may
import it.  A configuration error is raised as L{ConfigError} carrying one
line that names the key and the offending value, so that C{twistd} can
print it and exit without a traceback.
"""

from llmgw.config_checks.files import read_toml, told_in
from llmgw.config_checks.kinds import (
    BOOLEAN,
    COUNT,
    DURATION,
    POSITIVE,
    SIZE,
    Address,
    Boolean,
    Choice,
    Duration,
    Integer,
    Kind,
    ListOf,
    Number,
    Size,
    StringTable,
    Text,
    Url,
    duration_text,
    size_text,
)
from llmgw.config_checks.tables import (
    REQUIRED,
    ArrayOfTables,
    Check,
    Key,
    Table,
    check_keys,
    setting,
    settings_keys,
)
from llmgw.config_checks.values import (
    ConfigError,
    check_bool,
    check_choice,
    check_string,
    check_url,
    parse_duration,
    parse_size,
    parse_url,
    spelled,
)

__all__ = [
    "BOOLEAN",
    "COUNT",
    "DURATION",
    "POSITIVE",
    "REQUIRED",
    "SIZE",
    "Address",
    "Boolean",
    "Check",
    "Choice",
    "ConfigError",
    "Duration",
    "Integer",
    "Key",
    "Kind",
    "ListOf",
    "Number",
    "Size",
    "StringTable",
    "Table",
    "ArrayOfTables",
    "Text",
    "Url",
    "check_bool",
    "check_choice",
    "check_keys",
    "check_string",
    "check_url",
    "duration_text",
    "parse_duration",
    "parse_size",
    "parse_url",
    "read_toml",
    "setting",
    "settings_keys",
    "size_text",
    "spelled",
    "told_in",
]
