//! Tables of named choices, as verl's registries of advantage estimators and policy losses
//! are: one row per choice with the value, its YAML name and the other names it is read
//! from. Reading a config, writing the resolved YAML, `name()` and the list of accepted
//! names in an `unknown variant` error all come from the table, and a test holds the lists
//! of docs/algorithms.md (§5, §12) to it, so a choice (or an alias) is added in one place.
//!
//! The tables: [`ESTIMATORS`](super::algorithm::ESTIMATORS) (`algorithm.adv_estimator`) and
//! [`POLICY_LOSSES`](super::worker::POLICY_LOSSES) (`worker.actor.policy_loss`). Where
//! ares-core has a type for a setting, the config reads that type instead (see the `serde`
//! feature of ares-core).

use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, DeserializeSeed, EnumAccess, VariantAccess, Visitor};
use serde::{Deserializer, Serializer, ser};

/// One row of a table of choices.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Choice<T: 'static> {
    /// The value.
    pub value: T,
    /// Its YAML name: what the resolved config writes, and what messages call it.
    pub name: &'static str,
    /// The other names it is read from (verl's, older ones).
    pub aliases: &'static [&'static str],
}

/// A closed set of choices described by a table.
pub(crate) trait Choices: Copy + PartialEq + 'static {
    /// The type's name, for serde.
    const TYPE: &'static str;
    /// Every choice, once.
    const TABLE: &'static [Choice<Self>];
    /// Every name read, each choice's name followed by its aliases, in table order: the
    /// list an `unknown variant` error shows. Build it with [`spellings`].
    const SPELLINGS: &'static [&'static str];
}

/// The names and aliases of `table` in order, as a `const` array of exactly `N` (a wrong
/// `N` does not compile).
pub(crate) const fn spellings<T, const N: usize>(table: &[Choice<T>]) -> [&'static str; N] {
    let mut out = [""; N];
    let (mut n, mut i) = (0, 0);
    while i < table.len() {
        out[n] = table[i].name;
        n += 1;
        let mut j = 0;
        while j < table[i].aliases.len() {
            out[n] = table[i].aliases[j];
            n += 1;
            j += 1;
        }
        i += 1;
    }
    assert!(n == N, "N must be the number of names and aliases");
    out
}

/// The YAML name of `value` (every value has a row: the tables' tests check it).
pub(crate) fn name<T: Choices>(value: T) -> &'static str {
    T::TABLE
        .iter()
        .find(|c| c.value == value)
        .map_or("", |c| c.name)
}

/// The choice named `text` (its name or an alias).
pub(crate) fn parse<T: Choices>(text: &str) -> Option<T> {
    T::TABLE
        .iter()
        .find(|c| c.name == text || c.aliases.contains(&text))
        .map(|c| c.value)
}

/// Writes `value` as its name (a unit variant, as `#[derive(Serialize)]` writes one).
pub(crate) fn serialize<T: Choices, S: Serializer>(value: T, s: S) -> Result<S::Ok, S::Error> {
    match T::TABLE.iter().zip(0u32..).find(|(c, _)| c.value == value) {
        Some((c, index)) => s.serialize_unit_variant(T::TYPE, index, c.name),
        None => Err(ser::Error::custom(format!(
            "a {} missing from its table",
            T::TYPE
        ))),
    }
}

/// Reads a choice by name or alias, as `#[derive(Deserialize)]` reads a unit variant (so
/// the messages are serde's: `unknown variant `x`, expected one of ...`).
pub(crate) fn deserialize<'de, T: Choices, D: Deserializer<'de>>(d: D) -> Result<T, D::Error> {
    d.deserialize_enum(T::TYPE, T::SPELLINGS, EnumVisitor(PhantomData))
}

struct EnumVisitor<T>(PhantomData<T>);

impl<'de, T: Choices> Visitor<'de> for EnumVisitor<T> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "enum {}", T::TYPE)
    }

    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<T, A::Error> {
        let (value, variant) = data.variant_seed(NameSeed(PhantomData))?;
        variant.unit_variant()?;
        Ok(value)
    }
}

struct NameSeed<T>(PhantomData<T>);

impl<'de, T: Choices> DeserializeSeed<'de> for NameSeed<T> {
    type Value = T;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<T, D::Error> {
        d.deserialize_identifier(self)
    }
}

impl<'de, T: Choices> Visitor<'de> for NameSeed<T> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("variant identifier")
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<T, E> {
        parse(text).ok_or_else(|| E::unknown_variant(text, T::SPELLINGS))
    }
}

/// `Serialize` and `Deserialize` of a [`Choices`] type through its table.
macro_rules! serde_by_table {
    ($t:ty) => {
        impl serde::Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                $crate::config::choices::serialize(*self, s)
            }
        }

        impl<'de> serde::Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                $crate::config::choices::deserialize(d)
            }
        }
    };
}
pub(crate) use serde_by_table;

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Fruit {
        Apple,
        Pear,
    }

    const FRUITS: [Choice<Fruit>; 2] = [
        Choice {
            value: Fruit::Apple,
            name: "apple",
            aliases: &["malus"],
        },
        Choice {
            value: Fruit::Pear,
            name: "pear",
            aliases: &[],
        },
    ];
    const FRUIT_NAMES: [&str; 3] = spellings(&FRUITS);

    impl Choices for Fruit {
        const TYPE: &'static str = "Fruit";
        const TABLE: &'static [Choice<Self>] = &FRUITS;
        const SPELLINGS: &'static [&'static str] = &FRUIT_NAMES;
    }
    serde_by_table!(Fruit);

    fn read(json: &str) -> Result<Fruit, String> {
        serde_json::from_str(json).map_err(|e| e.to_string())
    }

    #[test]
    fn names_and_aliases_read_and_names_are_written() {
        assert_eq!(FRUIT_NAMES, ["apple", "malus", "pear"]);
        assert_eq!(read("\"malus\""), Ok(Fruit::Apple));
        assert_eq!(read("\"pear\""), Ok(Fruit::Pear));
        assert_eq!(read(r#"{"pear": null}"#), Ok(Fruit::Pear));
        assert_eq!(
            serde_json::to_string(&Fruit::Apple).ok().as_deref(),
            Some("\"apple\"")
        );
        assert_eq!(name(Fruit::Pear), "pear");
        assert_eq!(parse::<Fruit>("malus"), Some(Fruit::Apple));
        assert_eq!(parse::<Fruit>("Apple"), None);
        let err = read("\"plum\"").expect_err("no plum");
        assert!(
            err.starts_with("unknown variant `plum`, expected one of `apple`, `malus`, `pear`"),
            "{err}"
        );
        assert!(read("3").is_err());
    }

    /// Each value of `all` has exactly one row, and the table has no other rows.
    fn one_row_each<T: Choices + fmt::Debug>(all: &[T]) {
        assert_eq!(T::TABLE.len(), all.len());
        for v in all {
            let rows = T::TABLE.iter().filter(|c| c.value == *v).count();
            assert_eq!(rows, 1, "{v:?}");
            assert_eq!(parse::<T>(name(*v)), Some(*v));
        }
    }

    #[test]
    fn estimators_and_policy_losses_have_one_row_each() {
        use crate::config::{AdvEstimator as E, PolicyLoss as L};
        one_row_each(&[
            E::Grpo,
            E::DrGrpo,
            E::Rloo,
            E::Reinforce,
            E::ReinforceBaseline,
            E::ReinforceProMax,
        ]);
        one_row_each(&[
            L::Ppo,
            L::Gspo,
            L::GspoToken,
            L::Cispo,
            L::ClipCov,
            L::KlCov,
        ]);
        assert_eq!(parse::<E>("reinforce_plus_plus"), Some(E::Reinforce));
        assert_eq!(parse::<L>("vanilla"), Some(L::Ppo));
    }

    /// The table as docs/algorithms.md lists it: `` `a` (alias `b`), `c` ``.
    fn listed<T: Choices>() -> String {
        let row = |c: &Choice<T>| {
            let aliases: Vec<String> = c.aliases.iter().map(|a| format!("`{a}`")).collect();
            match aliases.len() {
                0 => format!("`{}`", c.name),
                1 => format!("`{}` (alias {})", c.name, aliases[0]),
                _ => format!("`{}` (aliases {})", c.name, aliases.join(", ")),
            }
        };
        T::TABLE.iter().map(row).collect::<Vec<_>>().join(", ")
    }

    #[test]
    fn the_spec_lists_every_name_and_alias() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/algorithms.md");
        let text = std::fs::read_to_string(path).expect("docs/algorithms.md");
        let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
        for (key, list) in [
            (
                "algorithm.adv_estimator",
                listed::<crate::config::AdvEstimator>(),
            ),
            (
                "worker.actor.policy_loss",
                listed::<crate::config::PolicyLoss>(),
            ),
        ] {
            let line = format!("`{key}` ({list})");
            assert!(
                text.contains(&line),
                "docs/algorithms.md should say: {line}"
            );
        }
    }

    #[test]
    fn unknown_names_list_what_is_accepted_as_serde_derive_did() {
        let err = |json: &str| {
            serde_json::from_str::<crate::config::AdvEstimator>(json)
                .map(drop)
                .map_err(|e| e.to_string())
        };
        assert_eq!(
            err("\"ppo\""),
            Err(
                "unknown variant `ppo`, expected one of `grpo`, `dr_grpo`, `rloo`, \
                 `reinforce`, `reinforce_plus_plus`, `reinforce_baseline`, \
                 `reinforce_plus_plus_baseline`, `reinforce_pro_max` at line 1 column 5"
                    .to_string()
            )
        );
        let err = serde_json::from_str::<crate::config::PolicyLoss>("\"grpo\"")
            .map(drop)
            .map_err(|e| e.to_string());
        assert_eq!(
            err,
            Err(
                "unknown variant `grpo`, expected one of `ppo`, `vanilla`, `gspo`, \
                 `gspo_token`, `cispo`, `clip_cov`, `kl_cov` at line 1 column 6"
                    .to_string()
            )
        );
    }
}
