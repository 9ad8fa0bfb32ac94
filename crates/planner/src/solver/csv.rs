//! The minimalloc CSV format, in and out.
//!
//! Input: a header line naming the columns, then one buffer per line. Required:
//! `id` (any text without commas), `lower`, `upper` (exclusive), `size`; optional:
//! `alignment` (a power of two, default 1) and, in solution files, `offset`. Like
//! minimalloc, `start`/`begin` are accepted for `lower`, `buffer`/`buffer_id` for `id`,
//! and `end` is an *inclusive* end (`upper = end + 1`). Fields are trimmed, CRLF and
//! blank lines are tolerated. Anything else is an error naming the file and line:
//! unknown or missing columns, wrong field counts, non-integers, negative or zero
//! sizes, `upper <= lower`, duplicate ids.
//!
//! Output ([`write_solution`]): `id,lower,upper,size[,alignment],offset`, the format
//! minimalloc writes, so other tools can check our plans. One pass, O(n).

use std::collections::HashMap;
use std::io::{self, Write};
use std::path::Path;

use stweaver_core::{Bytes, Offset};

use super::instance::{Buffer, Instance, Solution};

/// An instance read from CSV, with the buffers' ids (same order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CsvInstance {
    pub ids: Vec<String>,
    pub instance: Instance,
    /// Source line (1-based) of each buffer, for error messages.
    pub lines: Vec<usize>,
}

/// A solution file: the instance it restates plus the offsets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CsvSolution {
    pub csv: CsvInstance,
    pub offsets: Vec<Offset>,
}

/// What is wrong with a line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CsvProblem {
    #[error("the file is empty (expected a header such as `id,lower,upper,size`)")]
    Empty,
    #[error("the header lacks the `{0}` column")]
    MissingColumn(&'static str),
    #[error("unknown column `{0}` (expected id, lower, upper, size, alignment, offset)")]
    UnknownColumn(String),
    #[error("column `{0}` appears twice")]
    DuplicateColumn(String),
    #[error("expected {expected} fields, found {found}")]
    FieldCount { expected: usize, found: usize },
    #[error("`{column}` is `{value}`, not a non-negative integer")]
    BadInteger { column: &'static str, value: String },
    #[error("`size` is 0; every buffer needs at least one byte")]
    ZeroSize,
    #[error("empty lifetime: upper {upper} <= lower {lower}")]
    EmptyLifetime { lower: u64, upper: u64 },
    #[error("`alignment` {0} is not a power of two")]
    BadAlign(u64),
    #[error("`id` is empty")]
    EmptyId,
    #[error("id `{id}` was already used on line {first_line}")]
    DuplicateId { id: String, first_line: usize },
}

/// A CSV error, with where it happened.
#[derive(Debug, thiserror::Error)]
pub enum CsvError {
    #[error("{file}: {source}")]
    Io {
        file: String,
        #[source]
        source: io::Error,
    },
    #[error("{file}:{line}: {problem}")]
    Parse {
        file: String,
        line: usize,
        problem: CsvProblem,
    },
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Col {
    Id,
    Lower,
    Upper,
    End,
    Size,
    Align,
    Offset,
}

/// Reads an instance file.
pub fn read_instance(path: &Path) -> Result<CsvInstance, CsvError> {
    let text = read(path)?;
    parse_instance(&text, &path.display().to_string())
}

/// Reads a solution file (an instance file with an `offset` column).
pub fn read_solution(path: &Path) -> Result<CsvSolution, CsvError> {
    let text = read(path)?;
    parse_solution(&text, &path.display().to_string())
}

fn read(path: &Path) -> Result<String, CsvError> {
    std::fs::read_to_string(path).map_err(|source| CsvError::Io {
        file: path.display().to_string(),
        source,
    })
}

/// Parses instance text; `file` names it in errors. An `offset` column is ignored.
pub fn parse_instance(text: &str, file: &str) -> Result<CsvInstance, CsvError> {
    parse(text, file, false).map(|s| s.csv)
}

/// Parses solution text (an `offset` column is required).
pub fn parse_solution(text: &str, file: &str) -> Result<CsvSolution, CsvError> {
    parse(text, file, true)
}

fn parse(text: &str, file: &str, want_offsets: bool) -> Result<CsvSolution, CsvError> {
    let err = |line: usize, problem: CsvProblem| CsvError::Parse {
        file: file.to_string(),
        line,
        problem,
    };
    let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l.trim()));
    let (header_line, header) = loop {
        match lines.next() {
            None => return Err(err(1, CsvProblem::Empty)),
            Some((_, "")) => continue,
            Some(h) => break h,
        }
    };
    let mut cols: Vec<Col> = Vec::new();
    for name in header.split(',').map(str::trim) {
        let col = match name.to_ascii_lowercase().as_str() {
            "id" | "buffer" | "buffer_id" => Col::Id,
            "lower" | "start" | "begin" => Col::Lower,
            "upper" => Col::Upper,
            "end" => Col::End,
            "size" => Col::Size,
            "alignment" | "align" => Col::Align,
            "offset" => Col::Offset,
            _ => {
                return Err(err(
                    header_line,
                    CsvProblem::UnknownColumn(name.to_string()),
                ));
            }
        };
        let clash = cols.contains(&col)
            || (col == Col::End && cols.contains(&Col::Upper))
            || (col == Col::Upper && cols.contains(&Col::End));
        if clash {
            return Err(err(
                header_line,
                CsvProblem::DuplicateColumn(name.to_string()),
            ));
        }
        cols.push(col);
    }
    let required: [(&[Col], &'static str); 4] = [
        (&[Col::Id], "id"),
        (&[Col::Lower], "lower"),
        (&[Col::Upper, Col::End], "upper"),
        (&[Col::Size], "size"),
    ];
    for (options, name) in required {
        if !options.iter().any(|c| cols.contains(c)) {
            return Err(err(header_line, CsvProblem::MissingColumn(name)));
        }
    }
    if want_offsets && !cols.contains(&Col::Offset) {
        return Err(err(header_line, CsvProblem::MissingColumn("offset")));
    }

    let mut ids = Vec::new();
    let mut buffers = Vec::new();
    let mut offsets = Vec::new();
    let mut line_of = Vec::new();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (line, row) in lines {
        if row.is_empty() {
            continue;
        }
        let fields: Vec<&str> = row.split(',').map(str::trim).collect();
        if fields.len() != cols.len() {
            return Err(err(
                line,
                CsvProblem::FieldCount {
                    expected: cols.len(),
                    found: fields.len(),
                },
            ));
        }
        let (mut id, mut lower, mut upper, mut size, mut align, mut offset) =
            ("", 0u64, 0u64, 0u64, 1u64, 0u64);
        for (col, field) in cols.iter().zip(&fields) {
            let int = |column: &'static str| {
                field.parse::<u64>().map_err(|_| {
                    err(
                        line,
                        CsvProblem::BadInteger {
                            column,
                            value: field.to_string(),
                        },
                    )
                })
            };
            match col {
                Col::Id => id = field,
                Col::Lower => lower = int("lower")?,
                Col::Upper => upper = int("upper")?,
                Col::End => {
                    upper = int("end")?.checked_add(1).ok_or_else(|| {
                        err(
                            line,
                            CsvProblem::BadInteger {
                                column: "end",
                                value: field.to_string(),
                            },
                        )
                    })?
                }
                Col::Size => size = int("size")?,
                Col::Align => align = int("alignment")?,
                Col::Offset => offset = int("offset")?,
            }
        }
        if id.is_empty() {
            return Err(err(line, CsvProblem::EmptyId));
        }
        if size == 0 {
            return Err(err(line, CsvProblem::ZeroSize));
        }
        if upper <= lower {
            return Err(err(line, CsvProblem::EmptyLifetime { lower, upper }));
        }
        if !align.is_power_of_two() {
            return Err(err(line, CsvProblem::BadAlign(align)));
        }
        if let Some(&first_line) = seen.get(id) {
            return Err(err(
                line,
                CsvProblem::DuplicateId {
                    id: id.to_string(),
                    first_line,
                },
            ));
        }
        seen.insert(id.to_string(), line);
        ids.push(id.to_string());
        buffers.push(Buffer::new(lower, upper, Bytes(size)).with_align(Bytes(align)));
        offsets.push(Offset(offset));
        line_of.push(line);
    }
    Ok(CsvSolution {
        csv: CsvInstance {
            ids,
            instance: Instance::new(buffers),
            lines: line_of,
        },
        offsets: if want_offsets { offsets } else { Vec::new() },
    })
}

/// Writes `solution` for `instance` as `id,lower,upper,size[,alignment],offset`.
/// `ids` names the buffers (same order as the instance).
pub fn write_solution(
    mut out: impl Write,
    ids: &[String],
    instance: &Instance,
    solution: &Solution,
) -> io::Result<()> {
    let aligned = instance.buffers.iter().any(|b| b.align.0 != 1);
    if aligned {
        writeln!(out, "id,lower,upper,size,alignment,offset")?;
    } else {
        writeln!(out, "id,lower,upper,size,offset")?;
    }
    for ((id, b), off) in ids.iter().zip(&instance.buffers).zip(&solution.offsets) {
        if aligned {
            writeln!(
                out,
                "{id},{},{},{},{},{}",
                b.lower, b.upper, b.size.0, b.align.0, off.0
            )?;
        } else {
            writeln!(out, "{id},{},{},{},{}", b.lower, b.upper, b.size.0, off.0)?;
        }
    }
    out.flush()
}

/// Writes `solution` to the file at `path` (see [`write_solution`]).
pub fn write_solution_file(
    path: &Path,
    ids: &[String],
    instance: &Instance,
    solution: &Solution,
) -> Result<(), CsvError> {
    let io_err = |source| CsvError::Io {
        file: path.display().to_string(),
        source,
    };
    let f = std::fs::File::create(path).map_err(io_err)?;
    write_solution(io::BufWriter::new(f), ids, instance, solution).map_err(io_err)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problem(text: &str) -> (usize, CsvProblem) {
        match parse_instance(text, "t.csv") {
            Err(CsvError::Parse { line, problem, .. }) => (line, problem),
            other => panic!("expected a parse error, got {other:?}"),
        }
    }

    #[test]
    fn reads_the_minimalloc_example() {
        let text = "id,lower,upper,size\nb1,0,3,4\nb2,3,9,4\nb3,0,9,4\nb4,9,21,4\nb5,0,21,4\n";
        let csv = parse_instance(text, "input.12.csv").unwrap();
        assert_eq!(csv.ids, ["b1", "b2", "b3", "b4", "b5"]);
        assert_eq!(csv.instance.buffers[3], Buffer::new(9, 21, Bytes(4)));
        assert_eq!(csv.lines, [2, 3, 4, 5, 6]);
    }

    #[test]
    fn tolerates_crlf_spaces_aliases_and_inclusive_ends() {
        let text = "buffer, start, end, size, alignment\r\n x ,0,2, 8, 4\r\n\r\n";
        let csv = parse_instance(text, "t").unwrap();
        assert_eq!(csv.ids, ["x"]);
        assert_eq!(
            csv.instance.buffers[0],
            Buffer::new(0, 3, Bytes(8)).with_align(Bytes(4))
        );
    }

    #[test]
    fn names_the_line_of_each_problem() {
        assert_eq!(problem(""), (1, CsvProblem::Empty));
        assert_eq!(
            problem("id,lower,size\n"),
            (1, CsvProblem::MissingColumn("upper"))
        );
        assert_eq!(
            problem("id,lower,upper,size,gaps\n"),
            (1, CsvProblem::UnknownColumn("gaps".into()))
        );
        assert_eq!(
            problem("id,lower,upper,size,size\n"),
            (1, CsvProblem::DuplicateColumn("size".into()))
        );
        assert_eq!(
            problem("id,lower,upper,size\na,0,1,1\nb,0,1\n"),
            (
                3,
                CsvProblem::FieldCount {
                    expected: 4,
                    found: 3
                }
            )
        );
        assert_eq!(
            problem("id,lower,upper,size\na,0,1,-5\n"),
            (
                2,
                CsvProblem::BadInteger {
                    column: "size",
                    value: "-5".into()
                }
            )
        );
        assert_eq!(
            problem("id,lower,upper,size\na,0,x1,5\n"),
            (
                2,
                CsvProblem::BadInteger {
                    column: "upper",
                    value: "x1".into()
                }
            )
        );
        assert_eq!(
            problem("id,lower,upper,size\na,0,1,0\n"),
            (2, CsvProblem::ZeroSize)
        );
        assert_eq!(
            problem("id,lower,upper,size\na,4,4,1\n"),
            (2, CsvProblem::EmptyLifetime { lower: 4, upper: 4 })
        );
        assert_eq!(
            problem("id,lower,upper,size\na,0,1,1\n\nb,0,1,1\na,2,3,1\n"),
            (
                5,
                CsvProblem::DuplicateId {
                    id: "a".into(),
                    first_line: 2
                }
            )
        );
        assert_eq!(
            problem("id,lower,upper,size,alignment\na,0,1,1,3\n"),
            (2, CsvProblem::BadAlign(3))
        );
        assert_eq!(
            problem("id,lower,upper,size\n,0,1,1\n"),
            (2, CsvProblem::EmptyId)
        );
        let e = parse_instance("id,lower,upper,size\na,0,1,0\n", "x.csv").unwrap_err();
        assert_eq!(
            e.to_string(),
            "x.csv:2: `size` is 0; every buffer needs at least one byte"
        );
    }

    #[test]
    fn solutions_round_trip() {
        let text = "id,lower,upper,size\nb1,0,3,4\nb2,3,9,4\n";
        let csv = parse_instance(text, "t").unwrap();
        let sol = Solution {
            offsets: vec![Offset(0), Offset(4)],
            peak: Bytes(8),
        };
        let mut out = Vec::new();
        write_solution(&mut out, &csv.ids, &csv.instance, &sol).unwrap();
        let written = String::from_utf8(out).unwrap();
        assert_eq!(
            written,
            "id,lower,upper,size,offset\nb1,0,3,4,0\nb2,3,9,4,4\n"
        );
        let back = parse_solution(&written, "t").unwrap();
        assert_eq!(back.csv.instance, csv.instance);
        assert_eq!(back.offsets, sol.offsets);
        assert!(matches!(
            parse_solution(text, "t"),
            Err(CsvError::Parse {
                line: 1,
                problem: CsvProblem::MissingColumn("offset"),
                ..
            })
        ));
    }

    #[test]
    fn reports_missing_files() {
        let e = read_instance(Path::new("/nonexistent/x.csv")).unwrap_err();
        assert!(e.to_string().starts_with("/nonexistent/x.csv: "));
    }
}
