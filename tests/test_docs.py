"""README.md and docs/ read as a reference: short enough to read (the README a front page, each doc
under 300 lines), no words about how the work was organised (issue numbers, work sessions,
numbered rounds of attempts: that history is the git log's), and every file of this repository
they name exists."""
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, 'README.md')
DOCS = sorted(glob.glob(os.path.join(ROOT, 'docs', '*.md')))
PAGES = [README] + DOCS
MAX_LINES = {README: 120}
DOC_MAX_LINES = 300

ORDINAL = r'(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|next|earlier|previous|later)'
WORK_LOG = {
    'an issue': re.compile(r'\bissues?\b', re.I),
    'an issue number': re.compile(r'(?<![\w&/])#\d+\b'),
    'a work session': re.compile(r'\bsessions?\b(?!\.py)', re.I),
    'a round of work': re.compile(rf'\b{ORDINAL} rounds?\b|\brounds? \d+\b', re.I),
    'a numbered goal': re.compile(r'\bgoal \d+\b', re.I),
}
# A path of this repository; one in quotes is a user's file inside a quoted message, not ours.
REPO_PATH = re.compile(r"(?<![\w./'-])((?:checkpoint|configs|data|estimates|model|numerics|optim|parallel|tools|tests)"
                       r'/[a-z0-9_/]*[a-z0-9_]\.(?:py|sh))\b')


def _name(page):
  return os.path.relpath(page, ROOT)


def _lines(page):
  with open(page, encoding='utf-8') as f:
    return f.read().splitlines()


@pytest.mark.parametrize('page', PAGES, ids=_name)
def test_page_is_short(page):
  limit = MAX_LINES.get(page, DOC_MAX_LINES)
  assert len(_lines(page)) <= limit, f'{_name(page)} has {len(_lines(page))} lines; at most {limit}'


@pytest.mark.parametrize('page', PAGES, ids=_name)
def test_page_has_no_work_log(page):
  found = [f'{_name(page)}:{i}: {what}: {line.strip()[:120]}'
           for i, line in enumerate(_lines(page), 1)
           for what, pattern in WORK_LOG.items() if pattern.search(line)]
  assert not found, 'say what the software does, not how the work went:\n' + '\n'.join(found)


@pytest.mark.parametrize('page', PAGES, ids=_name)
def test_named_files_exist(page):
  text = '\n'.join(_lines(page))
  missing = sorted({p for p in REPO_PATH.findall(text) if not os.path.exists(os.path.join(ROOT, p))})
  assert not missing, f'{_name(page)} names files that do not exist: {missing}'
