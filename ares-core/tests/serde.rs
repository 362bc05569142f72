//! The `serde` feature: every name the `from_name` parsers accept reads back as the same
//! value, what is written is verl's name, and the structs are mappings with their field names.
#![cfg(feature = "serde")]

use ares_core::difficulty::{AccuracyThresholds, PerBucket};
use ares_core::kl::KlEstimator;
use ares_core::loss::{IsMode, LossAggMode};
use serde::Serialize;
use serde::de::DeserializeOwned;

fn read<T: DeserializeOwned>(json: &str) -> Result<T, String> {
    serde_json::from_str(json).map_err(|e| e.to_string())
}

fn write<T: Serialize>(value: &T) -> String {
    serde_json::to_string(value).expect("serialises")
}

fn read_name<T: DeserializeOwned>(name: &str) -> Result<T, String> {
    read(&format!("\"{name}\""))
}

#[test]
fn kl_estimators_read_every_name_and_write_verls() {
    let spellings = [
        "k1",
        "kl",
        "abs",
        "k2",
        "mse",
        "k3",
        "low_var_kl",
        "k1+",
        "kl+",
        "k3+",
        "low_var_kl+",
    ];
    for name in spellings {
        let parsed = KlEstimator::from_name(name).expect("a from_name spelling");
        assert_eq!(read_name::<KlEstimator>(name), Ok(parsed), "{name}");
    }
    let written: Vec<String> = KlEstimator::ALL.iter().map(write).collect();
    assert_eq!(
        written,
        [
            "\"kl\"",
            "\"abs\"",
            "\"mse\"",
            "\"low_var_kl\"",
            "\"k1+\"",
            "\"k3+\""
        ]
    );
    for e in KlEstimator::ALL {
        assert_eq!(read::<KlEstimator>(&write(&e)), Ok(e));
    }
    let err = read_name::<KlEstimator>("full").expect_err("not an estimator");
    assert!(err.contains("unknown variant `full`"), "{err}");
}

#[test]
fn loss_agg_modes_read_dashes_and_underscores() {
    for mode in LossAggMode::ALL {
        let name = mode.name();
        assert_eq!(write(&mode), format!("\"{name}\""));
        assert_eq!(read_name::<LossAggMode>(name), Ok(mode), "{name}");
        let underscored = name.replace('-', "_");
        assert_eq!(
            read_name::<LossAggMode>(&underscored),
            Ok(mode),
            "{underscored}"
        );
    }
    assert!(read_name::<LossAggMode>("token").is_err());
}

#[test]
fn is_modes_read_and_write_their_names() {
    for name in ["none", "tis", "icepop", "reinforce_pro"] {
        let mode = IsMode::from_name(name).expect("a from_name spelling");
        assert_eq!(read_name::<IsMode>(name), Ok(mode), "{name}");
        assert_eq!(write(&mode), format!("\"{name}\""));
    }
    assert!(read_name::<IsMode>("reinforce-pro").is_err());
}

#[test]
fn per_bucket_is_a_mapping_of_all_three() {
    let p = PerBucket::new(0.5, 0.25, 0.125);
    let json = write(&p);
    assert_eq!(json, r#"{"easy":0.5,"medium":0.25,"hard":0.125}"#);
    assert_eq!(read::<PerBucket<f64>>(&json), Ok(p));
    let err = read::<PerBucket<f64>>(r#"{"easy":1,"medium":2}"#).expect_err("hard missing");
    assert!(err.contains("missing field `hard`"), "{err}");
    let err =
        read::<PerBucket<f64>>(r#"{"easy":1,"medium":2,"hard":3,"x":4}"#).expect_err("unknown key");
    assert!(err.contains("unknown field `x`"), "{err}");
}

#[test]
fn accuracy_thresholds_default_what_is_left_out() {
    let t = AccuracyThresholds {
        easy: 0.75,
        medium: 0.25,
    };
    assert_eq!(read::<AccuracyThresholds<f64>>(&write(&t)), Ok(t));
    let partial: AccuracyThresholds<f64> = read(r#"{"easy":0.9}"#).expect("medium defaults");
    assert_eq!(partial.medium, AccuracyThresholds::<f64>::default().medium);
    assert_eq!(partial.easy, 0.9);
    assert!(read::<AccuracyThresholds<f32>>(r#"{"hard":0.1}"#).is_err());
}
