"""Run results shared by `flexlb bench` and `flexlb simulate`: records, flat metrics, files and tables."""

from app.report.output import TABLE_COLUMNS, markdown_table, print_table, rich_table, write_results
from app.report.records import RequestRecord
from app.report.summary import METRIC_KEYS, percentile, summarize

__all__ = [
    "METRIC_KEYS",
    "TABLE_COLUMNS",
    "RequestRecord",
    "markdown_table",
    "percentile",
    "print_table",
    "rich_table",
    "summarize",
    "write_results",
]
