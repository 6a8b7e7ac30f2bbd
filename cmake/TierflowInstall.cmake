# Install rules and the package config behind find_package(tierflow).
include(CMakePackageConfigHelpers)

get_property(_tierflow_modules GLOBAL PROPERTY TIERFLOW_MODULES)
install(TARGETS tierflow tierflow_build_flags ${_tierflow_modules}
        EXPORT tierflowTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(EXPORT tierflowTargets NAMESPACE tierflow::
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/tierflow)

configure_package_config_file(cmake/tierflowConfig.cmake.in
  ${PROJECT_BINARY_DIR}/tierflowConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/tierflow)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/tierflowConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/tierflowConfig.cmake
              ${PROJECT_BINARY_DIR}/tierflowConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/tierflow)
