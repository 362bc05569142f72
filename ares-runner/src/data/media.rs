//! Images and videos of a row: where they come from ([`MediaSource`]), how the `images` /
//! `videos` columns are read (paths relative to the dataset file, `{bytes, path}` structs as
//! Hugging Face `datasets` stores its `Image` feature in Parquet, base64 or byte lists in JSON
//! lines), and the `<image>` / `<video>` placeholders of a prompt (EasyR1's convention).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::criterion::kind;
use super::error::{DataError, Location, Result};
use super::keys::lookup;

/// The placeholder of an image in prompt text (EasyR1's convention).
pub const IMAGE_PLACEHOLDER: &str = "<image>";
/// The placeholder of a video in prompt text.
pub const VIDEO_PLACEHOLDER: &str = "<video>";

/// Extensions of still images, which are not videos.
const IMAGE_EXTENSIONS: [&str; 4] = ["png", "jpg", "jpeg", "webp"];

/// Where one image or video of a row comes from.
///
/// Serialised (in checkpoints) as the dataset gives it: `{"path": "…"}`, `{"bytes": "<base64>"}`
/// or `{"frames": ["…", …]}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MediaSource {
    /// A file (an image; a video file), or, for a video, a directory of frame images (sorted
    /// by name). Relative dataset paths are already joined to the dataset file's directory.
    Path(PathBuf),
    /// The encoded file itself (PNG / JPEG / WebP for an image; a video file's bytes).
    Bytes(#[serde(with = "base64_serde")] Vec<u8>),
    /// A video given as its frame images, in order.
    Frames(Vec<PathBuf>),
}

impl MediaSource {
    /// A short description for messages: the path, `<N bytes>` or the first frame.
    pub fn describe(&self) -> String {
        match self {
            MediaSource::Path(p) => p.display().to_string(),
            MediaSource::Bytes(b) => format!("<{} bytes>", b.len()),
            MediaSource::Frames(f) => match f.first() {
                Some(first) => format!("{} frames from {}", f.len(), first.display()),
                None => "no frames".into(),
            },
        }
    }
}

/// Images or videos: what the messages call them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MediaKind {
    /// An `images` column.
    Image,
    /// A `videos` column.
    Video,
}

impl MediaKind {
    pub(crate) fn noun(self) -> &'static str {
        match self {
            MediaKind::Image => "image",
            MediaKind::Video => "video",
        }
    }

    pub(crate) fn placeholder(self) -> &'static str {
        match self {
            MediaKind::Image => IMAGE_PLACEHOLDER,
            MediaKind::Video => VIDEO_PLACEHOLDER,
        }
    }
}

/// The media column at `key` of `row`, parsed and checked: every path exists (nothing is
/// decoded). Null, `[]`, `""` and `{}` mean no media. Relative paths are joined to
/// `base_dir`, else to the dataset file's directory. `global_id` names the row in errors.
pub(crate) fn media_column(
    row: &Map<String, Value>,
    key: &str,
    media: MediaKind,
    at: &Location,
    base_dir: Option<&Path>,
    global_id: &str,
) -> Result<Vec<MediaSource>> {
    let fail = |reason: String| DataError::media(at, global_id, key, reason);
    let items: Vec<&Value> = match lookup(row, key) {
        None => return Ok(Vec::new()),
        Some(Value::Array(items)) => items.iter().collect(),
        Some(Value::String(s)) if s.is_empty() => return Ok(Vec::new()),
        Some(Value::Object(o)) if o.is_empty() => return Ok(Vec::new()),
        // one item without the list (a non-list `Image` feature, a single path)
        Some(v @ (Value::String(_) | Value::Object(_))) => vec![v],
        Some(other) => {
            return Err(fail(format!(
                "{}, expected a list of {}s (paths or {{bytes, path}} structs)",
                kind(other),
                media.noun()
            )));
        }
    };
    let base = base_dir.unwrap_or_else(|| at.path.parent().unwrap_or(Path::new("")));
    items
        .into_iter()
        .enumerate()
        .map(|(i, v)| {
            let source =
                item(v, media, base).map_err(|e| fail(format!("{} {i}: {e}", media.noun())))?;
            check_exists(&source, media).map_err(|e| fail(format!("{} {i}: {e}", media.noun())))?;
            Ok(source)
        })
        .collect()
}

/// One item of a media column.
fn item(v: &Value, media: MediaKind, base: &Path) -> std::result::Result<MediaSource, String> {
    let expected = match media {
        MediaKind::Image => "expected a path or a {bytes, path} struct",
        MediaKind::Video => "expected a path, a {bytes, path} struct or a list of frame paths",
    };
    match v {
        Value::String(s) => path(s, base).map(MediaSource::Path),
        Value::Object(o) => {
            let bytes = o.get("bytes").filter(|b| !b.is_null());
            let p = o.get("path").filter(|p| !p.is_null());
            match (bytes, p) {
                // as `datasets` decodes its `Image` feature: the bytes win over the path
                (Some(b), _) => decode_bytes(b)
                    .map(MediaSource::Bytes)
                    .map_err(|e| format!("`bytes`: {e}")),
                (None, Some(Value::String(s))) => path(s, base).map(MediaSource::Path),
                (None, Some(other)) => Err(format!("`path` is {}, expected a string", kind(other))),
                (None, None) => Err(format!(
                    "a struct with neither `bytes` nor `path` (keys: {})",
                    if o.is_empty() {
                        "none".to_string()
                    } else {
                        o.keys().cloned().collect::<Vec<_>>().join(", ")
                    }
                )),
            }
        }
        Value::Array(a) if !a.is_empty() && a.iter().all(Value::is_number) => {
            decode_bytes(v).map(MediaSource::Bytes)
        }
        Value::Array(a) if media == MediaKind::Video && !a.is_empty() => a
            .iter()
            .enumerate()
            .map(|(j, f)| match f {
                Value::String(s) => path(s, base).map_err(|e| format!("frame {j}: {e}")),
                other => Err(format!("frame {j}: {}, expected a path", kind(other))),
            })
            .collect::<std::result::Result<Vec<_>, _>>()
            .map(MediaSource::Frames),
        other => Err(format!("{}, {expected}", kind(other))),
    }
}

/// A dataset path: relative ones are joined to the dataset file's directory.
fn path(s: &str, base: &Path) -> std::result::Result<PathBuf, String> {
    if s.trim().is_empty() {
        return Err("an empty path".into());
    }
    let lower = s.trim_start().to_ascii_lowercase();
    if lower.starts_with("http://") || lower.starts_with("https://") {
        return Err(format!(
            "`{s}` is a URL; download the file and give its path (or its bytes)"
        ));
    }
    let s = s.strip_prefix("file://").unwrap_or(s);
    let p = Path::new(s);
    Ok(if p.is_absolute() {
        p.to_path_buf()
    } else {
        base.join(p)
    })
}

/// Paths exist (files for images and frames; a file or a directory for a video); bytes are
/// not empty. Nothing is decoded.
fn check_exists(source: &MediaSource, media: MediaKind) -> std::result::Result<(), String> {
    let missing = |p: &Path| format!("no such file: {}", p.display());
    match source {
        MediaSource::Path(p) => match media {
            MediaKind::Image if p.is_file() => Ok(()),
            MediaKind::Image if p.is_dir() => Err(format!(
                "{} is a directory, expected an image file",
                p.display()
            )),
            MediaKind::Video if p.is_dir() => Ok(()),
            MediaKind::Video if p.is_file() && has_image_extension(p) => Err(format!(
                "{} is a single image, not a video (give a video file, a directory of frames or a list of frame files)",
                p.display()
            )),
            MediaKind::Video if p.is_file() => Ok(()),
            _ => Err(missing(p)),
        },
        MediaSource::Bytes(b) if b.is_empty() => Err("empty bytes".into()),
        MediaSource::Bytes(_) => Ok(()),
        MediaSource::Frames(frames) => match frames.iter().position(|f| !f.is_file()) {
            Some(j) => Err(format!("frame {j}: {}", missing(&frames[j]))),
            None => Ok(()),
        },
    }
}

fn has_image_extension(p: &Path) -> bool {
    p.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| IMAGE_EXTENSIONS.iter().any(|x| x.eq_ignore_ascii_case(e)))
}

/// Bytes given as base64 text (optionally a `data:…;base64,` URI) or as a list of numbers
/// 0..=255.
fn decode_bytes(v: &Value) -> std::result::Result<Vec<u8>, String> {
    let bytes = match v {
        Value::String(s) => base64_decode(s)?,
        Value::Array(a) => a
            .iter()
            .enumerate()
            .map(|(i, x)| {
                x.as_u64()
                    .and_then(|n| u8::try_from(n).ok())
                    .ok_or_else(|| format!("element {i} is {x}, expected a byte 0..=255"))
            })
            .collect::<std::result::Result<Vec<u8>, _>>()?,
        other => {
            return Err(format!(
                "{}, expected base64 text or a list of bytes",
                kind(other)
            ));
        }
    };
    if bytes.is_empty() {
        return Err("empty bytes".into());
    }
    Ok(bytes)
}

// ---------------------------------------------------------------------------------------------
// Placeholders
// ---------------------------------------------------------------------------------------------

/// A piece of prompt text split at the placeholders.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Piece<'a> {
    /// Text between placeholders (never empty).
    Text(&'a str),
    /// `<image>`.
    Image,
    /// `<video>`.
    Video,
}

/// `text` split at `<image>` / `<video>`, empty text pieces dropped (as EasyR1 builds its
/// content lists).
pub(crate) fn split_placeholders(text: &str) -> Vec<Piece<'_>> {
    let mut out = Vec::new();
    let mut rest = text;
    loop {
        let next = [
            (
                rest.find(IMAGE_PLACEHOLDER),
                Piece::Image,
                IMAGE_PLACEHOLDER,
            ),
            (
                rest.find(VIDEO_PLACEHOLDER),
                Piece::Video,
                VIDEO_PLACEHOLDER,
            ),
        ]
        .into_iter()
        .filter_map(|(pos, piece, tag)| pos.map(|p| (p, piece, tag)))
        .min_by_key(|&(p, _, _)| p);
        match next {
            Some((pos, piece, tag)) => {
                if pos > 0 {
                    out.push(Piece::Text(&rest[..pos]));
                }
                out.push(piece);
                rest = &rest[pos + tag.len()..];
            }
            None => {
                if !rest.is_empty() {
                    out.push(Piece::Text(rest));
                }
                return out;
            }
        }
    }
}

/// Number of `<image>` and `<video>` placeholders in `text`.
pub(crate) fn count_placeholders(text: &str) -> (usize, usize) {
    split_placeholders(text)
        .iter()
        .fold((0, 0), |(i, v), p| match p {
            Piece::Image => (i + 1, v),
            Piece::Video => (i, v + 1),
            Piece::Text(_) => (i, v),
        })
}

/// The message of a placeholder count that does not match the media of a row.
pub(crate) fn count_mismatch(media: MediaKind, have: usize, placeholders: usize) -> String {
    let noun = media.noun();
    format!(
        "the row has {have} {noun}(s) but its prompt has {placeholders} `{}` placeholder(s) \
         ({{\"type\": \"{noun}\"}} content items count as placeholders); put one placeholder \
         where each {noun} goes",
        media.placeholder()
    )
}

// ---------------------------------------------------------------------------------------------
// base64
// ---------------------------------------------------------------------------------------------

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding.
pub(crate) fn base64_encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (k, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if k <= chunk.len() {
                out.push(B64[((n >> shift) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Decodes base64 (standard or URL-safe alphabet, padding optional, ASCII whitespace ignored,
/// an optional `data:…;base64,` prefix).
pub(crate) fn base64_decode(text: &str) -> std::result::Result<Vec<u8>, String> {
    let text = match text.strip_prefix("data:") {
        Some(rest) => match rest.find(";base64,") {
            Some(i) => &rest[i + ";base64,".len()..],
            None => return Err("a data URI that is not base64".into()),
        },
        None => text,
    };
    let mut out = Vec::with_capacity(text.len() / 4 * 3);
    let mut acc = 0u32;
    let mut bits = 0u32;
    let mut padding = false;
    for (i, c) in text.bytes().enumerate() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' | b'-' => 62,
            b'/' | b'_' => 63,
            b'=' => {
                padding = true;
                continue;
            }
            c if c.is_ascii_whitespace() => continue,
            _ => {
                return Err(format!(
                    "not base64 text (character {:?} at {i})",
                    text[i..].chars().next().unwrap_or('?')
                ));
            }
        };
        if padding {
            return Err(format!("not base64 text (data after `=` padding at {i})"));
        }
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    if bits >= 6 {
        return Err("not base64 text (its length is not a valid base64 length)".into());
    }
    Ok(out)
}

/// `Vec<u8>` as base64 text in serde formats.
mod base64_serde {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::base64_encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        super::base64_decode(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn base64_round_trip() {
        for n in 0..40usize {
            let bytes: Vec<u8> = (0..n).map(|i| (i * 37 + 11) as u8).collect();
            let text = base64_encode(&bytes);
            assert_eq!(text.len() % 4, 0);
            assert_eq!(base64_decode(&text).unwrap(), bytes, "{n}");
            // unpadded and wrapped
            let bare = text.trim_end_matches('=');
            assert_eq!(base64_decode(bare).unwrap(), bytes);
            let wrapped: String = text
                .chars()
                .enumerate()
                .flat_map(|(i, c)| if i % 7 == 6 { vec![c, '\n'] } else { vec![c] })
                .collect();
            assert_eq!(base64_decode(&wrapped).unwrap(), bytes);
        }
        assert_eq!(base64_encode(b"Man"), "TWFu");
        assert_eq!(base64_encode(b"Ma"), "TWE=");
        assert_eq!(base64_encode(b"M"), "TQ==");
        assert_eq!(base64_decode("data:image/png;base64,TWFu").unwrap(), b"Man");
        assert_eq!(
            base64_decode("-_8=").unwrap(),
            base64_decode("+/8=").unwrap()
        );
        assert!(base64_decode("TW!u").unwrap_err().contains("'!' at 2"));
        assert!(base64_decode("TQ==TQ").unwrap_err().contains("padding"));
        assert!(base64_decode("TWFuT").unwrap_err().contains("length"));
    }

    #[test]
    fn serde_form() {
        let s = vec![
            MediaSource::Path("a/b.png".into()),
            MediaSource::Bytes(b"Man".to_vec()),
            MediaSource::Frames(vec!["f0.png".into(), "f1.png".into()]),
        ];
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(
            v,
            json!([{"path": "a/b.png"}, {"bytes": "TWFu"}, {"frames": ["f0.png", "f1.png"]}])
        );
        let back: Vec<MediaSource> = serde_json::from_value(v).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn placeholders() {
        use Piece::*;
        assert_eq!(
            split_placeholders("<image>Compare <image> and<video>."),
            vec![
                Image,
                Text("Compare "),
                Image,
                Text(" and"),
                Video,
                Text(".")
            ]
        );
        assert_eq!(split_placeholders(""), vec![]);
        assert_eq!(split_placeholders("<image><image>"), vec![Image, Image]);
        assert_eq!(split_placeholders("<imag>"), vec![Text("<imag>")]);
        assert_eq!(count_placeholders("a<video>b<image><video>"), (1, 2));
    }

    #[test]
    fn items() {
        let base = Path::new("/data/set");
        let img = |v: Value| item(&v, MediaKind::Image, base);
        let vid = |v: Value| item(&v, MediaKind::Video, base);
        assert_eq!(
            img(json!("img/a.png")).unwrap(),
            MediaSource::Path("/data/set/img/a.png".into())
        );
        assert_eq!(
            img(json!("/abs/a.png")).unwrap(),
            MediaSource::Path("/abs/a.png".into())
        );
        assert_eq!(
            img(json!({"bytes": "TWFu", "path": "ignored.png"})).unwrap(),
            MediaSource::Bytes(b"Man".to_vec())
        );
        assert_eq!(
            img(json!({"bytes": null, "path": "p.png"})).unwrap(),
            MediaSource::Path("/data/set/p.png".into())
        );
        assert_eq!(
            img(json!([137, 80, 78])).unwrap(),
            MediaSource::Bytes(vec![137, 80, 78])
        );
        assert_eq!(
            vid(json!(["f0.png", "f1.png"])).unwrap(),
            MediaSource::Frames(vec!["/data/set/f0.png".into(), "/data/set/f1.png".into()])
        );
        for (v, want) in [
            (
                json!(3),
                "a number, expected a path or a {bytes, path} struct",
            ),
            (json!(""), "an empty path"),
            (json!("https://x/a.png"), "is a URL"),
            (
                json!({"bytes": null, "path": null}),
                "neither `bytes` nor `path`",
            ),
            (json!({"path": 3}), "`path` is a number"),
            (json!({"bytes": [1, 300]}), "element 1 is 300"),
            (json!({"bytes": ""}), "empty bytes"),
            (json!(["a.png"]), "a list, expected a path or"),
        ] {
            let e = img(v.clone()).unwrap_err();
            assert!(e.contains(want), "{v}: {e}");
        }
        let e = vid(json!(["f0.png", 1])).unwrap_err();
        assert!(e.contains("frame 1: a number"), "{e}");
    }
}
