//! The sizes a Parquet file declares, checked before the `parquet` crate acts on them.
//!
//! The crate sizes a page's decompression buffer from the page header's
//! `uncompressed_page_size` and zero-fills it before decompressing: a 100-byte page that
//! declares 2 GiB costs 2 GiB of memory before the decoder finds the page short. So each
//! column chunk's page headers are read here first (Thrift compact protocol: two i32 fields
//! read, everything else skipped by type) and refused when a page declares
//! - more bytes than its column chunk declares in all, or
//! - more than [`MAX_SNAPPY_RATIO`] times its compressed size, where the chunk is Snappy
//!   compressed (Snappy's densest element, a 3-byte copy of 64 bytes, expands 21.3×);
//!
//! and each row group when its column chunks together declare more than the loader's limit.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};

use parquet::basic::Compression;
use parquet::file::metadata::{ColumnChunkMetaData, ParquetMetaData};

/// The most a Snappy page's declared uncompressed size may exceed its compressed size by
/// (× compressed + [`SNAPPY_SLACK`] bytes): above Snappy's 64/3 for any valid stream.
pub(crate) const MAX_SNAPPY_RATIO: u64 = 32;
const SNAPPY_SLACK: u64 = 64;
/// Thrift structs nest a few levels in a page header; a deeper one is malformed.
const MAX_DEPTH: u32 = 16;

/// Checks every row group's and page's declared sizes; `file_len` bytes in `file`.
///
/// # Errors
/// A message naming the row group, column and page that declares too much.
pub(crate) fn check_declared_sizes(
    file: &mut File,
    file_len: u64,
    meta: &ParquetMetaData,
    max_row_group_bytes: u64,
) -> Result<(), String> {
    for (g, rg) in meta.row_groups().iter().enumerate() {
        let declared = u64::try_from(rg.total_byte_size()).unwrap_or(u64::MAX);
        let columns: u64 = rg
            .columns()
            .iter()
            .map(|c| u64::try_from(c.uncompressed_size()).unwrap_or(u64::MAX))
            .fold(0, u64::saturating_add);
        let most = declared.max(columns);
        if most > max_row_group_bytes {
            return Err(format!(
                "row group {g} declares {} uncompressed, more than {}; write the file with \
                 smaller row groups (pyarrow's row_group_size)",
                size(most),
                size(max_row_group_bytes)
            ));
        }
        for c in rg.columns() {
            check_chunk(file, file_len, c)
                .map_err(|e| format!("row group {g}, column {}: {e}", c.column_path().string()))?;
        }
    }
    Ok(())
}

/// `b` bytes in MiB where they make at least one.
fn size(b: u64) -> String {
    if b >= 1 << 20 {
        format!("{} MiB", b >> 20)
    } else {
        format!("{b} bytes")
    }
}

/// Walks one column chunk's page headers.
fn check_chunk(file: &mut File, file_len: u64, c: &ColumnChunkMetaData) -> Result<(), String> {
    let start = c.dictionary_page_offset().unwrap_or(c.data_page_offset());
    let (Ok(start), Ok(len), Ok(total)) = (
        u64::try_from(start),
        u64::try_from(c.compressed_size()),
        u64::try_from(c.uncompressed_size()),
    ) else {
        return Err("a negative offset or size in the footer".into());
    };
    let end = start.saturating_add(len);
    if end > file_len {
        return Err(format!(
            "the chunk declares bytes {start}..{end}, past the file's end ({file_len})"
        ));
    }
    let snappy = c.compression() == Compression::SNAPPY;
    let mut buf = Vec::new();
    let (mut pos, mut page) = (start, 0usize);
    while pos < end {
        let h = read_page_header(file, pos, end, &mut buf)
            .map_err(|e| format!("page {page} at byte {pos}: {e}"))?;
        let (Ok(uncompressed), Ok(compressed)) = (
            u64::try_from(h.uncompressed_size),
            u64::try_from(h.compressed_size),
        ) else {
            return Err(format!("page {page} at byte {pos}: a negative page size"));
        };
        let next = pos + h.header_len as u64;
        check_page(uncompressed, compressed, end - next, total, snappy)
            .map_err(|e| format!("page {page} at byte {pos} {e}"))?;
        pos = next + compressed;
        page += 1;
    }
    Ok(())
}

/// One page's declared sizes against what holds them: `room` bytes left in the chunk, the
/// chunk's declared `total` uncompressed, Snappy's expansion when `snappy`.
fn check_page(
    uncompressed: u64,
    compressed: u64,
    room: u64,
    total: u64,
    snappy: bool,
) -> Result<(), String> {
    if compressed > room {
        return Err(format!(
            "declares {compressed} bytes, past its column chunk's end"
        ));
    }
    if uncompressed > total {
        return Err(format!(
            "declares {uncompressed} bytes uncompressed, more than its whole column chunk \
             ({total})"
        ));
    }
    if snappy && uncompressed > compressed * MAX_SNAPPY_RATIO + SNAPPY_SLACK {
        return Err(format!(
            "declares {uncompressed} bytes from {compressed} Snappy bytes, more than Snappy \
             expands to"
        ));
    }
    Ok(())
}

/// The parts of a page header the checks need.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct PageSizes {
    pub header_len: usize,
    pub uncompressed_size: i64,
    pub compressed_size: i64,
}

/// Reads the header at `pos`, from a window that grows (×4, from 256 bytes) while the
/// header runs past it, never past `end`.
fn read_page_header(
    file: &mut File,
    pos: u64,
    end: u64,
    buf: &mut Vec<u8>,
) -> Result<PageSizes, String> {
    let mut window = 256u64;
    loop {
        let n = window.min(end - pos);
        buf.clear();
        file.seek(SeekFrom::Start(pos))
            .and_then(|_| file.by_ref().take(n).read_to_end(buf))
            .map_err(|e| format!("reading: {e}"))?;
        match parse_page_header(buf) {
            Ok(h) => return Ok(h),
            Err(Short::NeedMore) if n < end - pos => window = window.saturating_mul(4),
            Err(Short::NeedMore) => return Err("the header runs past the chunk's end".into()),
            Err(Short::Bad(e)) => return Err(e),
        }
    }
}

/// Why a header did not parse: the bytes ran out (read more), or they are malformed.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Short {
    NeedMore,
    Bad(String),
}

/// Parses a Thrift-compact `PageHeader` from the start of `bytes`: field 2
/// (`uncompressed_page_size`) and 3 (`compressed_page_size`), both required i32.
pub(crate) fn parse_page_header(bytes: &[u8]) -> Result<PageSizes, Short> {
    let mut c = Cursor { bytes, pos: 0 };
    let (mut uncompressed, mut compressed) = (None, None);
    let mut id: i64 = 0;
    loop {
        let head = c.byte()?;
        if head == 0 {
            break;
        }
        let ty = head & 0x0f;
        id = match head >> 4 {
            0 => unzigzag(c.varint()?),
            delta => id + i64::from(delta),
        };
        match (id, ty) {
            (2, 5) => uncompressed = Some(unzigzag(c.varint()?)),
            (3, 5) => compressed = Some(unzigzag(c.varint()?)),
            _ => c.skip(ty, 0)?,
        }
    }
    match (uncompressed, compressed) {
        (Some(uncompressed_size), Some(compressed_size)) => Ok(PageSizes {
            header_len: c.pos,
            uncompressed_size,
            compressed_size,
        }),
        _ => Err(Short::Bad("a page header without its sizes".into())),
    }
}

fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl Cursor<'_> {
    fn byte(&mut self) -> Result<u8, Short> {
        let b = *self.bytes.get(self.pos).ok_or(Short::NeedMore)?;
        self.pos += 1;
        Ok(b)
    }

    fn advance(&mut self, n: u64) -> Result<(), Short> {
        let left = (self.bytes.len() - self.pos) as u64;
        if n > left {
            return Err(Short::NeedMore);
        }
        self.pos += n as usize;
        Ok(())
    }

    /// A ULEB128 varint of at most 10 bytes.
    fn varint(&mut self) -> Result<u64, Short> {
        let mut v = 0u64;
        for i in 0..10 {
            let b = self.byte()?;
            v |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(Short::Bad("a varint longer than 10 bytes".into()))
    }

    /// Skips one value of compact type `ty`; every type takes at least one byte in a
    /// collection, so a declared count larger than the bytes runs out rather than loops.
    fn skip(&mut self, ty: u8, depth: u32) -> Result<(), Short> {
        if depth > MAX_DEPTH {
            return Err(Short::Bad("Thrift structs nested too deeply".into()));
        }
        match ty {
            // a bool field's value is its type
            1 | 2 => Ok(()),
            3 => self.advance(1),
            4..=6 => self.varint().map(drop),
            7 => self.advance(8),
            8 => {
                let n = self.varint()?;
                self.advance(n)
            }
            9 | 10 => {
                let head = self.byte()?;
                let n = match head >> 4 {
                    15 => self.varint()?,
                    n => u64::from(n),
                };
                self.elements(n, &[head & 0x0f], depth)
            }
            11 => {
                let n = self.varint()?;
                if n == 0 {
                    return Ok(());
                }
                let kv = self.byte()?;
                self.elements(n, &[kv >> 4, kv & 0x0f], depth)
            }
            12 => loop {
                let head = self.byte()?;
                if head == 0 {
                    return Ok(());
                }
                if head >> 4 == 0 {
                    self.varint()?;
                }
                self.skip(head & 0x0f, depth + 1)?;
            },
            _ => Err(Short::Bad(format!("unknown Thrift type {ty}"))),
        }
    }

    /// `n` collection elements, each of `types` in turn (a map's key, then its value).
    fn elements(&mut self, n: u64, types: &[u8], depth: u32) -> Result<(), Short> {
        for _ in 0..n {
            for &t in types {
                if matches!(t, 1 | 2) {
                    // in a collection a bool takes one byte
                    self.advance(1)?;
                } else {
                    self.skip(t, depth + 1)?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zigzag(v: i64) -> u64 {
        ((v << 1) ^ (v >> 63)) as u64
    }

    fn varint(mut v: u64, out: &mut Vec<u8>) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }

    /// type = DATA_PAGE (0), the two sizes, a crc, then a data_page_header struct holding
    /// an i32, a nested statistics struct with a binary and a bool, and a list of i32.
    fn header(uncompressed: i64, compressed: i64) -> Vec<u8> {
        let mut h = vec![0x15];
        varint(zigzag(0), &mut h);
        h.push(0x15);
        varint(zigzag(uncompressed), &mut h);
        h.push(0x15);
        varint(zigzag(compressed), &mut h);
        h.push(0x15);
        varint(zigzag(-7), &mut h); // crc
        h.push(0x1c); // field 5: struct
        h.push(0x15);
        varint(zigzag(3), &mut h);
        h.push(0x2c); // field 3 of it: statistics struct
        h.push(0x18); // binary
        varint(3, &mut h);
        h.extend_from_slice(b"abc");
        h.push(0x11); // bool true
        h.push(0x00);
        h.push(0x19); // list
        h.push(0x25); // 2 × i32
        varint(zigzag(1), &mut h);
        varint(zigzag(2), &mut h);
        h.push(0x00); // end of data_page_header
        h.push(0x00); // end of PageHeader
        h
    }

    #[test]
    fn a_page_header_reads_its_two_sizes_and_length() {
        let h = header(1_000_000, 70_000);
        let mut bytes = h.clone();
        bytes.extend_from_slice(&[9; 20]); // the page's data follows
        assert_eq!(
            parse_page_header(&bytes),
            Ok(PageSizes {
                header_len: h.len(),
                uncompressed_size: 1_000_000,
                compressed_size: 70_000,
            })
        );
        // every prefix asks for more bytes: none parses as a shorter header
        for n in 0..h.len() {
            assert_eq!(parse_page_header(&h[..n]), Err(Short::NeedMore), "{n}");
        }
    }

    /// A file the `parquet` crate writes passes; a row-group limit below what it declares
    /// refuses it by name.
    #[test]
    fn row_groups_are_checked_against_the_limit() {
        use parquet::data_type::{ByteArray, ByteArrayType};
        use parquet::file::properties::WriterProperties;
        use parquet::file::reader::{FileReader, SerializedFileReader};
        use parquet::file::writer::SerializedFileWriter;
        use std::sync::Arc;

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rows.parquet");
        let schema = parquet::schema::parser::parse_message_type(
            "message m { REQUIRED BYTE_ARRAY prompt (UTF8); }",
        )
        .unwrap();
        let props = WriterProperties::builder()
            .set_compression(Compression::SNAPPY)
            .build();
        let mut w = SerializedFileWriter::new(
            File::create(&path).unwrap(),
            Arc::new(schema),
            Arc::new(props),
        )
        .unwrap();
        let mut rg = w.next_row_group().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        let rows: Vec<ByteArray> = (0..50)
            .map(|i| format!("What is {i}+{i}?").into_bytes().into())
            .collect();
        col.typed::<ByteArrayType>()
            .write_batch(&rows, None, None)
            .unwrap();
        col.close().unwrap();
        rg.close().unwrap();
        w.close().unwrap();

        let reader = SerializedFileReader::new(File::open(&path).unwrap()).unwrap();
        let meta = reader.metadata();
        let mut f = File::open(&path).unwrap();
        let len = f.metadata().unwrap().len();
        check_declared_sizes(&mut f, len, meta, 1 << 30).unwrap();
        let e = check_declared_sizes(&mut f, len, meta, 100).unwrap_err();
        assert!(
            e.starts_with("row group 0 declares ") && e.contains("more than 100 bytes"),
            "{e}"
        );
        // a file cut short: its chunk's bytes lie past the end
        let e = check_declared_sizes(&mut f, 10, meta, 1 << 30).unwrap_err();
        assert!(
            e.contains("column prompt") && e.contains("past the file's end"),
            "{e}"
        );
    }

    #[test]
    fn pages_are_checked_against_their_chunk_and_codec() {
        // (uncompressed, compressed, room, total, snappy)
        assert!(check_page(1000, 100, 100, 1000, true).is_ok());
        assert!(check_page(100 * 32 + 64, 100, 100, 1 << 20, true).is_ok());
        let e = check_page(100 * 32 + 65, 100, 100, 1 << 20, true).unwrap_err();
        assert!(e.contains("3265 bytes from 100 Snappy bytes"), "{e}");
        // uncompressed pages have no ratio to keep
        assert!(check_page(100 * 32 + 65, 100, 100, 1 << 20, false).is_ok());
        let e = check_page(1001, 100, 100, 1000, false).unwrap_err();
        assert!(e.contains("more than its whole column chunk (1000)"), "{e}");
        let e = check_page(10, 101, 100, 1000, false).unwrap_err();
        assert!(e.contains("past its column chunk's end"), "{e}");
    }

    #[test]
    fn malformed_headers_are_errors() {
        // an unknown type
        assert!(matches!(parse_page_header(&[0x1d]), Err(Short::Bad(_))));
        // a header with no sizes
        assert!(matches!(
            parse_page_header(&[0x15, 0x00, 0x00]),
            Err(Short::Bad(_))
        ));
        // structs nested past the limit
        let mut deep = vec![0x1c; 40];
        deep.push(0);
        assert!(matches!(parse_page_header(&deep), Err(Short::Bad(_))));
        // an 11-byte varint
        let mut long = vec![0x15];
        long.extend_from_slice(&[0xff; 11]);
        assert!(matches!(parse_page_header(&long), Err(Short::Bad(_))));
        // a list declaring 2^60 elements runs out of bytes, quickly
        let mut list = vec![0x19, 0xf5];
        varint(1 << 60, &mut list);
        list.extend_from_slice(&[2; 100]);
        assert_eq!(parse_page_header(&list), Err(Short::NeedMore));
    }
}
