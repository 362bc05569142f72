//! The built-in `calculator` tool: exact arithmetic on integers and fractions of any size.
//!
//! `+ - * /` (also `×`, `÷`), `^` or `**` with an integer exponent (`2^-1` is `1/2`),
//! parentheses, unary signs, decimals (`0.25` is `1/4`). Precedence as in Python: `^`
//! binds tighter than a unary minus (`-2^2` is `-4`) and is right-associative. The result
//! is an integer, or a fraction in lowest terms (`7/12`) — never a rounded float, so a
//! model learns arithmetic that is right.
//!
//! Bounded, since a model writes the expressions: at most [`MAX_EXPRESSION_BYTES`] of
//! input, [`MAX_DEPTH`] nested parentheses, and no value past [`MAX_BITS`] bits (checked
//! before a power is computed).

use num_bigint::BigInt;
use num_integer::Integer;
use num_traits::{One, Signed, ToPrimitive, Zero};

/// Longest expression accepted.
pub const MAX_EXPRESSION_BYTES: usize = 1000;
/// Deepest nesting of parentheses (and unary signs).
pub const MAX_DEPTH: usize = 64;
/// Largest numerator or denominator, in bits (~30 000 decimal digits).
pub const MAX_BITS: u64 = 100_000;

/// A fraction in lowest terms, denominator > 0.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Q {
    num: BigInt,
    den: BigInt,
}

impl Q {
    fn int(n: BigInt) -> Self {
        Q {
            num: n,
            den: BigInt::one(),
        }
    }

    fn new(num: BigInt, den: BigInt) -> Result<Self, String> {
        if den.is_zero() {
            return Err("division by zero".into());
        }
        let g = num.gcd(&den);
        let (mut num, mut den) = (num / &g, den / &g);
        if den.is_negative() {
            num = -num;
            den = -den;
        }
        let q = Q { num, den };
        q.bounded()
    }

    fn bounded(self) -> Result<Self, String> {
        if self.num.bits() > MAX_BITS || self.den.bits() > MAX_BITS {
            return Err(format!("the result passes {MAX_BITS} bits"));
        }
        Ok(self)
    }

    fn add(&self, o: &Q) -> Result<Q, String> {
        Q::new(&self.num * &o.den + &o.num * &self.den, &self.den * &o.den)
    }

    fn sub(&self, o: &Q) -> Result<Q, String> {
        Q::new(&self.num * &o.den - &o.num * &self.den, &self.den * &o.den)
    }

    fn mul(&self, o: &Q) -> Result<Q, String> {
        Q::new(&self.num * &o.num, &self.den * &o.den)
    }

    fn div(&self, o: &Q) -> Result<Q, String> {
        Q::new(&self.num * &o.den, &self.den * &o.num)
    }

    fn pow(&self, e: &Q) -> Result<Q, String> {
        if !e.den.is_one() {
            return Err("exponents must be integers".into());
        }
        if self.den.is_one() && self.num.abs() <= BigInt::one() {
            // 0, 1 and -1 stay small whatever the exponent
            let odd = e.num.is_odd();
            return match (self.num.is_zero(), e.num.is_negative(), e.num.is_zero()) {
                (_, _, true) => Ok(Q::int(BigInt::one())),
                (true, true, _) => Err("division by zero".into()),
                (true, false, _) => Ok(Q::int(BigInt::zero())),
                _ if self.num.is_negative() && odd => Ok(self.clone()),
                _ => Ok(Q::int(BigInt::one())),
            };
        }
        // |x| ≥ 2^(bits-1), so x^e has at least (bits-1)·e bits: refuse before computing
        let bits = self.num.bits().max(self.den.bits());
        let exp = e
            .num
            .abs()
            .to_u64()
            .filter(|&x| x.saturating_mul(bits - 1) <= MAX_BITS)
            .ok_or_else(|| format!("the power passes {MAX_BITS} bits"))?;
        let exp = u32::try_from(exp).map_err(|_| format!("the power passes {MAX_BITS} bits"))?;
        let (num, den) = (self.num.pow(exp), self.den.pow(exp));
        if e.num.is_negative() {
            Q::new(den, num)
        } else {
            Q::new(num, den)
        }
    }

    fn render(&self) -> String {
        if self.den.is_one() {
            self.num.to_string()
        } else {
            format!("{}/{}", self.num, self.den)
        }
    }
}

/// Evaluates `expression`; the result as an integer or a fraction in lowest terms.
///
/// # Errors
/// A message for the model: what is wrong and where (byte offset), or which bound was hit.
pub fn evaluate(expression: &str) -> Result<String, String> {
    if expression.len() > MAX_EXPRESSION_BYTES {
        return Err(format!(
            "the expression is {} bytes long, more than {MAX_EXPRESSION_BYTES}",
            expression.len()
        ));
    }
    let mut p = Parser {
        chars: expression.char_indices().collect(),
        at: 0,
        depth: 0,
        len: expression.len(),
    };
    let q = p.expr()?;
    p.skip_space();
    if let Some(&(i, c)) = p.chars.get(p.at) {
        return Err(format!("unexpected {c:?} at byte {i}"));
    }
    Ok(q.render())
}

struct Parser {
    chars: Vec<(usize, char)>,
    at: usize,
    depth: usize,
    len: usize,
}

impl Parser {
    fn skip_space(&mut self) {
        while self
            .chars
            .get(self.at)
            .is_some_and(|(_, c)| c.is_whitespace())
        {
            self.at += 1;
        }
    }

    fn peek(&mut self) -> Option<char> {
        self.skip_space();
        self.chars.get(self.at).map(|&(_, c)| c)
    }

    fn offset(&self) -> usize {
        self.chars.get(self.at).map_or(self.len, |&(i, _)| i)
    }

    fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(c) {
            self.at += 1;
            true
        } else {
            false
        }
    }

    fn expr(&mut self) -> Result<Q, String> {
        let mut acc = self.term()?;
        loop {
            if self.eat('+') {
                acc = acc.add(&self.term()?)?;
            } else if self.eat('-') {
                acc = acc.sub(&self.term()?)?;
            } else {
                return Ok(acc);
            }
        }
    }

    fn term(&mut self) -> Result<Q, String> {
        let mut acc = self.unary()?;
        loop {
            if self.peek() == Some('*') && self.chars.get(self.at + 1).map(|&(_, c)| c) == Some('*')
            {
                // `**` is a power, handled below a unary
                return Ok(acc);
            }
            if self.eat('*') || self.eat('×') {
                acc = acc.mul(&self.unary()?)?;
            } else if self.eat('/') || self.eat('÷') {
                acc = acc.div(&self.unary()?)?;
            } else {
                return Ok(acc);
            }
        }
    }

    fn unary(&mut self) -> Result<Q, String> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(format!("nested more than {MAX_DEPTH} deep"));
        }
        let q = if self.eat('-') {
            let q = self.unary()?;
            Q::int(BigInt::zero()).sub(&q)
        } else if self.eat('+') {
            self.unary()
        } else {
            self.power()
        };
        self.depth -= 1;
        q
    }

    fn power(&mut self) -> Result<Q, String> {
        let base = self.atom()?;
        let starred =
            self.peek() == Some('*') && self.chars.get(self.at + 1).map(|&(_, c)| c) == Some('*');
        if starred {
            self.at += 2;
        } else if !self.eat('^') {
            return Ok(base);
        }
        let exponent = self.unary()?;
        base.pow(&exponent)
    }

    fn atom(&mut self) -> Result<Q, String> {
        if self.eat('(') {
            self.depth += 1;
            if self.depth > MAX_DEPTH {
                return Err(format!("nested more than {MAX_DEPTH} deep"));
            }
            let q = self.expr()?;
            self.depth -= 1;
            if !self.eat(')') {
                return Err(format!("expected ')' at byte {}", self.offset()));
            }
            return Ok(q);
        }
        match self.peek() {
            Some(c) if c.is_ascii_digit() || c == '.' => self.number(),
            Some(c) => Err(format!("unexpected {c:?} at byte {}", self.offset())),
            None => Err("the expression ends where a number was expected".into()),
        }
    }

    /// `123`, `1.5`, `.5`, `2.` as exact fractions.
    fn number(&mut self) -> Result<Q, String> {
        let start = self.offset();
        let mut digits = String::new();
        let mut scale = 0u32;
        let mut point = false;
        while let Some(&(_, c)) = self.chars.get(self.at) {
            if c.is_ascii_digit() {
                digits.push(c);
                scale += u32::from(point);
            } else if c == '.' && !point {
                point = true;
            } else {
                break;
            }
            self.at += 1;
        }
        if digits.is_empty() {
            return Err(format!("a lone '.' at byte {start}"));
        }
        let num: BigInt = digits
            .parse()
            .map_err(|_| format!("a malformed number at byte {start}"))?;
        Q::new(num, BigInt::from(10).pow(scale))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_and_fractions_are_exact() {
        for (expr, want) in [
            ("1+2*3", "7"),
            ("(1+2)*3", "9"),
            ("1/3 + 1/6", "1/2"),
            ("7/12 - 1", "-5/12"),
            ("2^10", "1024"),
            ("2**-2", "1/4"),
            ("-2^2", "-4"),
            ("(-2)^2", "4"),
            ("2^3^2", "512"),
            ("0.25 * 8", "2"),
            ("1.5 + .5", "2"),
            ("12 × 3 ÷ 4", "9"),
            ("6/-4", "-3/2"),
            ("- - 3", "3"),
            (
                "123456789012345678901234567890 * 987654321098765432109876543210",
                "121932631137021795226185032733622923332237463801111263526900",
            ),
            ("10^30 + 1", "1000000000000000000000000000001"),
        ] {
            assert_eq!(evaluate(expr).as_deref(), Ok(want), "{expr}");
        }
    }

    #[test]
    fn bad_expressions_say_what_and_where() {
        for (expr, part) in [
            ("1/0", "division by zero"),
            ("0^-1", "division by zero"),
            ("2^(1/2)", "integers"),
            ("1 +", "ends where a number"),
            ("(1+2", "expected ')'"),
            ("1 2", "unexpected '2' at byte 2"),
            ("x+1", "unexpected 'x' at byte 0"),
            (".", "lone '.'"),
            ("", "ends where a number"),
        ] {
            let e = evaluate(expr).unwrap_err();
            assert!(e.contains(part), "{expr}: {e}");
        }
    }

    #[test]
    fn costs_are_bounded() {
        assert!(
            evaluate(&"1+".repeat(600))
                .unwrap_err()
                .contains("bytes long")
        );
        assert!(
            evaluate(&format!("{}1{}", "(".repeat(100), ")".repeat(100)))
                .unwrap_err()
                .contains("nested")
        );
        assert!(
            evaluate(&format!("{}1", "-".repeat(100)))
                .unwrap_err()
                .contains("nested")
        );
        // refused before computing: 10^(10^9) would be 3.3 × 10^9 bits
        assert!(evaluate("10^1000000000").unwrap_err().contains("bits"));
        assert!(evaluate("2^99999").is_ok());
        assert!(evaluate("2^100000").unwrap_err().contains("bits"));
        assert!(
            evaluate("(2^60000)*(2^60000)")
                .unwrap_err()
                .contains("bits")
        );
        assert_eq!(evaluate("1^1000000000000").as_deref(), Ok("1"));
        assert_eq!(evaluate("(-1)^1000000000001").as_deref(), Ok("-1"));
        assert_eq!(evaluate("0^0").as_deref(), Ok("1"));
        assert_eq!(evaluate("(1/2)^-3").as_deref(), Ok("8"));
    }
}
