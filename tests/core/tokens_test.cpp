// Token metadata: time order, text streams and validation.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <doctest/doctest.h>
#include <infkv/tokens.hpp>

using namespace infkv;

TEST_CASE("time_order sorts by position and keeps slot order among equal positions") {
  const std::vector<token> t{{3, 0, modality::text}, {1, 0, modality::image}, {3, 1, modality::video},
                             {0, 0, modality::text}, {1, 0, modality::image}, {3, 2, modality::audio}};
  CHECK(time_order(t) == std::vector<std::int64_t>{3, 1, 4, 0, 2, 5});
  CHECK(time_order(std::vector<token>{}).empty());

  // many ties in reverse slot order of a large list: still stable
  std::vector<token> many;
  for (int i = 0; i < 1000; ++i) many.push_back({(999 - i) / 10, 0, modality::text});
  const auto order = time_order(many);
  for (std::size_t i = 1; i < order.size(); ++i) {
    const auto a = std::size_t(order[i - 1]), b = std::size_t(order[i]);
    REQUIRE(many[a].pos <= many[b].pos);
    if (many[a].pos == many[b].pos) REQUIRE(a < b);
  }
}

TEST_CASE("text_tokens numbers a text stream from `first` in one segment") {
  const auto t = text_tokens(4, 10, 7);
  REQUIRE(t.size() == 4);
  for (std::size_t i = 0; i < t.size(); ++i) {
    CHECK(t[i].pos == 10 + std::int64_t(i));
    CHECK(t[i].segment == 7);
    CHECK(t[i].kind == modality::text);
  }
  const auto d = text_tokens(3);
  CHECK(d[0].pos == 0);
  CHECK(d[2].pos == 2);
  CHECK(d[1].segment == 0);
  CHECK(text_tokens(0).empty());
  CHECK(text_tokens(-5).empty());
}

TEST_CASE("validate_tokens checks the count and the positions, naming the argument") {
  const auto t = text_tokens(5);
  CHECK_NOTHROW(validate_tokens(t, 5));
  CHECK_NOTHROW(validate_tokens(std::vector<token>{}, 0));
  CHECK_THROWS_WITH_AS(validate_tokens(t, 6), doctest::Contains("tokens.size() = 5"), error);
  CHECK_THROWS_WITH_AS(validate_tokens(t, 6), doctest::Contains("(6)"), error);
  CHECK_THROWS_WITH_AS(validate_tokens(t, 4, "window"), doctest::Contains("window.size() = 5"), error);
  auto bad = t;
  bad[2].pos = -1;
  CHECK_THROWS_WITH_AS(validate_tokens(bad, 5), doctest::Contains("tokens[2].pos = -1"), error);
  CHECK_THROWS_AS(validate_tokens(bad, 5), infkv::invalid_argument);
  bad[2].pos = 0;  // repeated positions are allowed (M-RoPE image tokens)
  CHECK_NOTHROW(validate_tokens(bad, 5));
}

TEST_CASE("modality names") {
  CHECK(std::string(to_string(modality::text)) == "text");
  CHECK(std::string(to_string(modality::image)) == "image");
  CHECK(std::string(to_string(modality::video)) == "video");
  CHECK(std::string(to_string(modality::audio)) == "audio");
}
